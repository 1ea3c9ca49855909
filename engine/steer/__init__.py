"""Control vectors: the speed projection, its kernels' dispatch, the states cvec training captures."""
