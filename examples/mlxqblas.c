/* MLX's Linux CPU wheel links a reference BLAS (~100x slower GEMM than OpenBLAS here).
   Without root, examples/blas.sh installs OpenBLAS from PyPI (scipy-openblas32, whose
   symbols carry a scipy_ prefix) and builds this shim: the three cblas_*gemm calls MLX
   makes, forwarded to it; it preloads it (LD_PRELOAD) where Debian's libopenblas0-pthread
   is not installed. */
typedef int I; /* scipy-openblas32: 32-bit integers, as the CBLAS ABI MLX calls */

void scipy_cblas_sgemm(I, I, I, I, I, I, float, const float *, I, const float *, I, float,
                       float *, I);
void scipy_cblas_dgemm(I, I, I, I, I, I, double, const double *, I, const double *, I,
                       double, double *, I);
void scipy_cblas_cgemm(I, I, I, I, I, I, const void *, const void *, I, const void *, I,
                       const void *, void *, I);

void cblas_sgemm(I o, I ta, I tb, I m, I n, I k, float al, const float *a, I lda,
                 const float *b, I ldb, float be, float *c, I ldc) {
    scipy_cblas_sgemm(o, ta, tb, m, n, k, al, a, lda, b, ldb, be, c, ldc);
}

void cblas_dgemm(I o, I ta, I tb, I m, I n, I k, double al, const double *a, I lda,
                 const double *b, I ldb, double be, double *c, I ldc) {
    scipy_cblas_dgemm(o, ta, tb, m, n, k, al, a, lda, b, ldb, be, c, ldc);
}

void cblas_cgemm(I o, I ta, I tb, I m, I n, I k, const void *al, const void *a, I lda,
                 const void *b, I ldb, const void *be, void *c, I ldc) {
    scipy_cblas_cgemm(o, ta, tb, m, n, k, al, a, lda, b, ldb, be, c, ldc);
}
