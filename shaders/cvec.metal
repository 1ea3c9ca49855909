// Control vector ("speed projection") kernel body for mx.fast.metal_kernel.
//
// This file is the BODY only: MLX generates the signature (see MLX's "Custom Metal Kernels"
// guide). engine/steering.py reads it at import and builds the kernel with
//   input_names  = ["h", "vec", "scale"]     h: the rows, row-contiguous, dtype T
//                                             vec: float32 (D,)  (project: unit v; add: d)
//                                             scale: float32 (1,)  -> s
//   output_names = ["out"]                   out: same shape and dtype as h
//   template     = T (dtype of h), D (row width), TG (threads per threadgroup, multiple of 32,
//                  <= 1024), PROJECT (bool)
//   grid = (rows * TG, 1, 1), threadgroup = (TG, 1, 1): one threadgroup per row.
//
// Fused form (the header defines CVEC_RESIDUAL; one more input, `res`, same shape and dtype as h):
// the row is x = h + res, the block's last residual add, rounded to T as the unfused add is; the
// steered block then costs no extra kernel at all (the add is replaced, not followed).
//
// project: out = h - s (h.v) v   (dot in fp32: per-thread strided partials, simd_sum, then the
//                                 per-simdgroup partials reduced by simdgroup 0)
// add:     out = h + s d
// One body, two backends: engine/steering.py prepends a shim header. METAL_SHIM defines
// CVEC_SHARED as `threadgroup`; CUDA_SHIM (for mx.fast.cuda_kernel) defines it as `__shared__` and
// maps the Metal names used here (thread indices, simd_sum, threadgroup_barrier, uint/ulong) onto
// CUDA's. Keep to those names, or add them to both shims.
// Status: the CUDA build is compiled and checked against a float64 reference on an NVIDIA H200
// (tests/engine/test_steering_kernels.py, see bench/gpu.md). The Metal build has NEVER been compiled or
// run anywhere (no Mac in the CI that wrote it); the same test runs it on a Mac.

CVEC_SHARED float cvec_partials[32];

#ifdef CVEC_RESIDUAL
#define CVEC_X(i) float(static_cast<T>(h[i] + res[i]))
#else
#define CVEC_X(i) float(h[i])
#endif

const uint row = threadgroup_position_in_grid.x;
const uint tid = thread_position_in_threadgroup.x;
const ulong base = ulong(row) * ulong(D);
const float s = scale[0];

float coef = s;
if (PROJECT) {
    float part = 0.0f;
    for (uint j = tid; j < uint(D); j += uint(TG)) {
        part += CVEC_X(base + j) * vec[j];
    }
    part = simd_sum(part);
    if (thread_index_in_simdgroup == 0) {
        cvec_partials[simdgroup_index_in_threadgroup] = part;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (simdgroup_index_in_threadgroup == 0) {
        float p = (thread_index_in_simdgroup < simdgroups_per_threadgroup)
                      ? cvec_partials[thread_index_in_simdgroup]
                      : 0.0f;
        p = simd_sum(p);
        if (thread_index_in_simdgroup == 0) {
            cvec_partials[0] = p;
        }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    coef = -s * cvec_partials[0];
}

for (uint j = tid; j < uint(D); j += uint(TG)) {
    out[base + j] = static_cast<T>(CVEC_X(base + j) + coef * vec[j]);
}
