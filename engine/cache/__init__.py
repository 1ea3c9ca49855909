"""A conversation's K/V in memory: the cache contract, the live and parked conversations, their keys and formats, the idle-time top-up."""
