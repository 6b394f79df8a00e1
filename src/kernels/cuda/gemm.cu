/*
 * gemm.cu — the CUDA plugin's GEMM: cuBLAS, fp32 (no TF32), and bf16 weights with the activations
 * rounded to bf16 on the device and fp32 accumulation.
 */
#include "cuda_common.cuh"

namespace mdt_cuda {

__nv_bfloat16 *g_xh;
size_t g_xh_n;

/* ---------------- GEMM ---------------- */

/* y[M, N] = x[M, K] w[N, K]^T (+ b): column-major y^T = w^T... i.e. C(N x M) = op(W) X. */
static void be_linear(const float *x, int64_t ldx, const float *w, const uint16_t *wh,
                      const float *b, float *y, int64_t ldy, int64_t M, int64_t K, int64_t N) {
    const float one = 1.0f, zero = 0.0f;
    cublasStatus_t st;
    if (wh) {
        const size_t need = (size_t)(M * K);
        if (need > g_xh_n) {
            cudaFree(g_xh);
            g_xh = NULL, g_xh_n = 0;
            if (ck(cudaMalloc(&g_xh, need * 2), "bf16 activation scratch"))
                return;
            g_xh_n = need;
            note_peak();
        }
        k_to_bf16<<<rows_grid(M, K, 256), 256, 0, g_stream>>>(g_xh, x, ldx, M, K);
        launched("linear: to bf16");
        st = cublasGemmEx(g_blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)N, (int)M, (int)K, &one, wh,
                          CUDA_R_16BF, (int)K, g_xh, CUDA_R_16BF, (int)K, &zero, y, CUDA_R_32F,
                          (int)ldy, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    } else {
        st = cublasSgemm(g_blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)N, (int)M, (int)K, &one, w, (int)K,
                         x, (int)ldx, &zero, y, (int)ldy);
    }
    if (st != CUBLAS_STATUS_SUCCESS)
        fail("cuBLAS GEMM (M=%lld K=%lld N=%lld) failed with status %d", (long long)M,
             (long long)K, (long long)N, (int)st);
    if (b)
        be_add_bias(y, ldy, b, M, N);
}

void fill_gemm(mdt_kernel_ops *o) { o->linear = be_linear; }

} // namespace mdt_cuda
