/* dpopt._native: the CPU kernels of dpopt, compiled once when the package is built.
 *
 *   ziggurat_fill   the body of the CPU Gaussian sampler (dpopt.ziggurat: Marsaglia & Tsang 2000 on SFC64)
 *   ziggurat_fill_chunks  the same on the chunks of a whole draw, claimed by the calling threads (dpopt.noise)
 *   release         the release's one pass: out = rnd(z*scale + s) [/ divisor] (dpopt.privatizer.add_and_round)
 *   row_sq_norms64  per-row float64 squared norms of float32 rows (dpopt.engine.row_norms)
 *   sq_round_up     float64 squared norms (or products of two) times a margin, rounded UP into float32
 *                   (dpopt.engine.row_norms.round_up_sq_norms)
 *   sq_group_totals float32 per-parameter norms summed per clip group in float64, times a margin, rounded UP
 *                   into float32 (dpopt.engine.fast.FastPerSampleGrads._sq_norms)
 *   clip_factors32  min(1, C/sqrt(S)) rounded DOWN into float32 (dpopt.privatizer.clip_factors)
 *
 * Each takes numpy arrays (the buffer protocol) and runs with the GIL released, so Python threads run it in
 * parallel on disjoint pieces (the last three work on [B] or [B, G] vectors, microseconds: they keep the GIL). The Python wrappers check shapes and dtypes; these functions check them again
 * (sizes, formats, contiguity, writability) and raise ValueError rather than read or write out of bounds.
 *
 * Floating point: built with -ffp-contract=off (setup: pyproject.toml's ext-modules), so a*b + c is a product
 * and a sum each rounded once, never a fused multiply-add, and no -ffast-math: sums are not reassociated.
 * These are the semantics the tests check bit for bit against torch/numpy expressions.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(_MSC_VER)
#include <intrin.h> /* _InterlockedExchangeAdd64 */
#endif

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__) && defined(__GLIBC__)
/* one AVX2 build and one baseline build of a loop; the loader picks one per CPU (GCC function multi-versioning,
 * which needs glibc's ifunc: not on musl) */
#define DPOPT_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define DPOPT_CLONES
#endif

/* ------------------------------------------------------------------------------------------------ buffers */

static int get_buffer(PyObject *obj, Py_buffer *view, int writable, const char *name) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) != 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s must be a C-contiguous%s numpy array", name,
                     writable ? " writable" : "");
        return -1;
    }
    return 0;
}

/* The buffers one call holds: each acquired by take() and all released, in reverse order, by release_all() (on
 * every path: success and each error). */
#define MAX_BUFFERS 8
typedef struct {
    Py_buffer view[MAX_BUFFERS];
    int n;
} Buffers;

/* obj's buffer as the next view of bs, or NULL with a ValueError set */
static Py_buffer *take(Buffers *bs, PyObject *obj, int writable, const char *name) {
    Py_buffer *v = &bs->view[bs->n];
    if (get_buffer(obj, v, writable, name) < 0) return NULL;
    bs->n++;
    return v;
}

static void release_all(Buffers *bs) {
    while (bs->n > 0) PyBuffer_Release(&bs->view[--bs->n]);
}

/* the element kind of a buffer: 'f' float32, 'd' float64, 'Q' uint64, 'q' int64, 0 otherwise */
static char kind_of(const Py_buffer *v) {
    const char *f = v->format ? v->format : "B";
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    if (*f == '<') f++; /* little-endian: this machine's order */
#elif defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    if (*f == '>' || *f == '!') f++;
#endif
    if (*f == '=' || *f == '@') f++; /* native order (and '@': native alignment, the same for these types) */
    if (f[0] == '\0' || f[1] != '\0') return 0;
    switch (f[0]) {
        case 'f': return v->itemsize == 4 ? 'f' : 0;
        case 'd': return v->itemsize == 8 ? 'd' : 0;
        case 'Q': case 'L': return v->itemsize == 8 ? 'Q' : 0;
        case 'q': case 'l': return v->itemsize == 8 ? 'q' : 0;
        default: return 0;
    }
}

static Py_ssize_t count_of(const Py_buffer *v) { return v->itemsize ? v->len / v->itemsize : 0; }

/* ----------------------------------------------------------------------------------------------- ziggurat */

/* SFC64 (Doty-Humphrey): tmp = a + b + counter++; a = b ^ (b >> 11); b = c + (c << 3); c = rotl(c, 24) + tmp */
#define SFC_STEP(out)                                     \
    do {                                                  \
        uint64_t t_ = a + b + n_;                         \
        n_ += 1;                                          \
        a = b ^ (b >> 11);                                \
        b = c + (c << 3);                                 \
        c = ((c << 24) | (c >> 40)) + t_;                 \
        (out) = t_;                                       \
    } while (0)

/* x (>= 0) with the sign bit `sign` (0 or 1 << 63) set: no branch on a random bit */
static inline double with_sign(double x, uint64_t sign) {
    uint64_t bits;
    memcpy(&bits, &x, sizeof bits);
    bits |= sign;
    memcpy(&x, &bits, sizeof bits);
    return x;
}

/* the body on out[i, n) (i = 0 for a whole chunk; later where the lanes below stopped, `tails` tail positions
 * already found); the first `cap` tail positions go to tail_idx; returns the number of tail positions */
static Py_ssize_t zig_loop(double *out, Py_ssize_t i, Py_ssize_t n, uint64_t *s, Py_ssize_t discard,
                           const uint64_t *k, const double *w, const double *f, int64_t *tail_idx, Py_ssize_t cap,
                           Py_ssize_t tails) {
    uint64_t a = s[0], b = s[1], c = s[2], n_ = s[3], tmp;
    const double to_unit = 1.0 / 9007199254740992.0; /* 2^-53 */
    for (Py_ssize_t d = 0; d < discard; d++) SFC_STEP(tmp);
    while (i < n) {
        SFC_STEP(tmp);
        unsigned strip = (unsigned)(tmp & 0xFF);
        uint64_t rabs = (tmp >> 9) & 0xFFFFFFFFFFFFFULL;
        double x = (double)(int64_t)rabs * w[strip]; /* rabs < 2^52: the signed conversion is exact (and cheaper) */
        uint64_t sign = (tmp & 0x100) << 55; /* bit 8 of the word, as the sign bit of a double */
        if (rabs < k[strip]) {
            out[i++] = with_sign(x, sign);
            continue;
        }
        if (strip == 0) { /* the tail branch: filled by the caller */
            if (tails < cap) tail_idx[tails] = (int64_t)i;
            tails++;
            out[i++] = with_sign(INFINITY, sign);
            continue;
        }
        SFC_STEP(tmp);
        double u = (double)(int64_t)(tmp >> 11) * to_unit; /* < 2^53: exact */
        if (f[strip] + u * (f[strip - 1] - f[strip]) < exp(-0.5 * x * x)) out[i++] = with_sign(x, sign);
    }
    s[0] = a; s[1] = b; s[2] = c; s[3] = n_;
    return tails;
}

PyDoc_STRVAR(ziggurat_fill_doc,
"ziggurat_fill(out, state, discard, k, w, f, tail_idx) -> int\n\n"
"Fill float64 out [n] from the SFC64 stream state (uint64 [4], advanced in place) after dropping `discard`\n"
"outputs; the tail branch's positions get +-inf and are written to tail_idx (int64 [>= n]); returns their\n"
"number. k uint64 [256], w and f float64 [256]: the tables of dpopt.ziggurat. GIL released.");

static PyObject *ziggurat_fill(PyObject *self, PyObject *args) {
    PyObject *o_out, *o_state, *o_k, *o_w, *o_f, *o_tail;
    Py_ssize_t discard;
    if (!PyArg_ParseTuple(args, "OOnOOOO", &o_out, &o_state, &discard, &o_k, &o_w, &o_f, &o_tail)) return NULL;
    Buffers bs = {.n = 0};
    PyObject *result = NULL;
    Py_buffer *out, *state, *k, *w, *f, *tail;
    if (!(out = take(&bs, o_out, 1, "out")) || !(state = take(&bs, o_state, 1, "state")) ||
        !(k = take(&bs, o_k, 0, "k")) || !(w = take(&bs, o_w, 0, "w")) || !(f = take(&bs, o_f, 0, "f")) ||
        !(tail = take(&bs, o_tail, 1, "tail_idx")))
        goto done;
    Py_ssize_t n = count_of(out);
    if (kind_of(out) != 'd' || kind_of(state) != 'Q' || count_of(state) != 4 || kind_of(k) != 'Q' ||
        count_of(k) != 256 || kind_of(w) != 'd' || count_of(w) != 256 || kind_of(f) != 'd' || count_of(f) != 256 ||
        kind_of(tail) != 'q' || count_of(tail) < n || discard < 0) {
        PyErr_SetString(PyExc_ValueError,
                        "ziggurat_fill takes out float64 [n], state uint64 [4], discard >= 0, k uint64 [256], "
                        "w and f float64 [256], tail_idx int64 [>= n]");
        goto done;
    }
    Py_ssize_t tails;
    Py_BEGIN_ALLOW_THREADS
    tails = zig_loop((double *)out->buf, 0, n, (uint64_t *)state->buf, discard, (const uint64_t *)k->buf,
                     (const double *)w->buf, (const double *)f->buf, (int64_t *)tail->buf, n, 0);
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(tails);
done:
    release_all(&bs);
    return result;
}

PyDoc_STRVAR(ziggurat_fill_chunks_doc,
"ziggurat_fill_chunks(out, states, next, chunk, discard, k, w, f, tail_idx, cap, tail_count) -> int\n\n"
"ziggurat_fill on the chunks of float64 out [n] (chunk i: out[i*chunk : min(n, (i+1)*chunk)], its stream the\n"
"i-th row of states uint64 [m, 4], m = ceil(n / chunk), advanced in place), each chunk claimed by an atomic\n"
"increment of next[0] (int64): callers in several threads share the chunks, each filled exactly once; where next\n"
"has a second element, a call stops claiming once next[1] is non-zero (a pause: the chunks it left stay unclaimed\n"
"for a later call). Chunk\n"
"i's first cap tail positions (relative to its start) go to row i of tail_idx (int64 [m, cap]), their number\n"
"(which may exceed cap: the caller then redraws the chunk) to tail_count[i] (int64 [m]). Returns the number of\n"
"chunks this call filled. GIL released throughout.");

/* the next unclaimed chunk (an atomic fetch-and-add on the shared counter) */
static inline int64_t claim(int64_t *next) {
#if defined(__GNUC__) || defined(__clang__)
    return __atomic_fetch_add(next, 1, __ATOMIC_RELAXED);
#elif defined(_MSC_VER)
    return _InterlockedExchangeAdd64((volatile __int64 *)next, 1);
#else
#error "ziggurat_fill_chunks needs an atomic fetch-and-add"
#endif
}

/* whether the caller asked the workers to stop claiming chunks (next[1] != 0: CpuNormalDraw.pause) */
static inline int paused(const int64_t *stop) {
#if defined(__GNUC__) || defined(__clang__)
    return __atomic_load_n(stop, __ATOMIC_RELAXED) != 0;
#else
    return *(const volatile int64_t *)stop != 0;
#endif
}

/* ---------------------------------------------------------------- ziggurat_fill_chunks: chunks in SIMD lanes
 *
 * Each chunk has its own SFC64 stream, so a thread that holds L = 4 chunks runs their L loops side by side, one
 * chunk per 64-bit lane of an AVX2 vector: every step draws one word in each lane (the same SFC64 step, on that
 * lane's own state), makes its candidate x = rabs * w[strip] (rabs < 2^52 turned into a double exactly: its bits
 * under the exponent of 2^52, minus 2^52; then one IEEE product, as in zig_loop) and tests rabs < k[strip]
 * (64-bit compares; k < 2^63 checked by the caller). A lane that passes stores x with its sign at its chunk's next
 * position. A lane that fails (≈ 1.2 % of candidates) goes through the rest of zig_loop's body in scalar code,
 * on that lane's own state (zig_slow: the tail marker, or one more word and the wedge test), before the next
 * step. So each lane consumes exactly its chunk's words in zig_loop's order and computes the same expressions:
 * the values, the tail positions and the final states are bit-identical to zig_loop's on each chunk.
 *
 * A lane whose chunk is full stores its state and tail count and claims the next chunk (the same claim and the
 * same pause test as the scalar loop, one chunk at a time); a lane left without a chunk keeps running on its
 * stale state, its results written to a scratch row and never read. With one live lane left its chunk is
 * finished by zig_loop (from where the lane stopped): 4 lanes cost about what 2 scalar loops do.
 * x86-64 GCC/glibc builds only (the same guard as DPOPT_CLONES), chosen at run time on CPUs with AVX2; other
 * builds and CPUs run zig_loop per chunk. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__) && defined(__GLIBC__)
#define DPOPT_ZIG_LANES 4
#include <immintrin.h>

/* the rest of zig_loop's body for the word `tmp` that failed the fast test, `next` the stream's word after it
 * (used only by the wedge test): the same expressions as zig_loop, in the same order. Returns 0 (rejected: no
 * value), 1 (*v: the value) or 2 (the tail branch, which draws no word: *v = +-inf). Not inlined into the AVX2
 * function, so that it is compiled exactly as zig_loop is. */
__attribute__((noinline)) static int zig_slow(uint64_t tmp, uint64_t next, const uint64_t *k, const double *w,
                                              const double *f, double *v) {
    const double to_unit = 1.0 / 9007199254740992.0; /* 2^-53 */
    unsigned strip = (unsigned)(tmp & 0xFF);
    uint64_t rabs = (tmp >> 9) & 0xFFFFFFFFFFFFFULL;
    double x = (double)(int64_t)rabs * w[strip];
    uint64_t sign = (tmp & 0x100) << 55;
    if (rabs < k[strip]) { /* not reached from the lanes (their test is this one); kept for completeness */
        *v = with_sign(x, sign);
        return 1;
    }
    if (strip == 0) {
        *v = with_sign(INFINITY, sign);
        return 2;
    }
    double u = (double)(int64_t)(next >> 11) * to_unit;
#ifdef ZIG_NOEXP
    int accepted = f[strip] + u * (f[strip - 1] - f[strip]) < 0.5 * x;
#else
    int accepted = f[strip] + u * (f[strip - 1] - f[strip]) < exp(-0.5 * x * x);
#endif
    if (accepted) *v = with_sign(x, sign);
    return accepted;
}

/* lane_mask[m]: all ones in the 64-bit lanes j whose bit j of m is set (a blend's selector) */
static const int64_t lane_mask[16][4] = {
    {0, 0, 0, 0}, {-1, 0, 0, 0}, {0, -1, 0, 0}, {-1, -1, 0, 0}, {0, 0, -1, 0}, {-1, 0, -1, 0}, {0, -1, -1, 0},
    {-1, -1, -1, 0}, {0, 0, 0, -1}, {-1, 0, 0, -1}, {0, -1, 0, -1}, {-1, -1, 0, -1}, {0, 0, -1, -1},
    {-1, 0, -1, -1}, {0, -1, -1, -1}, {-1, -1, -1, -1},
};

/* what the lanes share: the job's arrays, and each lane's chunk and position in it */
typedef struct {
    double *o;               /* out [n] */
    uint64_t *st;            /* states [m, 4] */
    int64_t *next, *ti, *tc; /* the claim counter; tail_idx [m, cap]; tail_count [m] */
    const int64_t *stop;     /* the pause flag, or NULL */
    Py_ssize_t n, m, chunk, discard, cap, done;
    int exhausted;                                                 /* a claim returned no chunk: no more claims */
    uint64_t a[DPOPT_ZIG_LANES], b[DPOPT_ZIG_LANES], c[DPOPT_ZIG_LANES], cnt[DPOPT_ZIG_LANES]; /* lane states */
    double *p[DPOPT_ZIG_LANES], *start[DPOPT_ZIG_LANES], *end[DPOPT_ZIG_LANES]; /* next output, chunk bounds */
    int64_t id[DPOPT_ZIG_LANES];                                   /* the lane's chunk, -1: none */
    Py_ssize_t tails[DPOPT_ZIG_LANES];
} Lanes;

/* lane j takes the next unclaimed chunk (as the scalar loop claims: pause test, then claim), its state past the
 * discarded words; returns 1, or 0 (no chunk: the lane is dead) */
static int lane_claim(Lanes *L, int j) {
    L->id[j] = -1;
    if (L->exhausted || (L->stop && paused(L->stop))) return 0;
    int64_t i = claim(L->next);
    if (i < 0 || i >= L->m) {
        L->exhausted = 1;
        return 0;
    }
    Py_ssize_t lo = (Py_ssize_t)i * L->chunk, len = L->n - lo < L->chunk ? L->n - lo : L->chunk;
    uint64_t *s = L->st + 4 * i, a = s[0], b = s[1], c = s[2], n_ = s[3], tmp;
    for (Py_ssize_t d = 0; d < L->discard; d++) SFC_STEP(tmp);
    (void)tmp;
    L->a[j] = a; L->b[j] = b; L->c[j] = c; L->cnt[j] = n_;
    L->id[j] = i;
    L->p[j] = L->start[j] = L->o + lo;
    L->end[j] = L->o + lo + len;
    L->tails[j] = 0;
    L->done++;
    return 1;
}

/* lane j's chunk is full: its state and tail count go back to the job */
static void lane_store(Lanes *L, int j) {
    uint64_t *s = L->st + 4 * L->id[j];
    s[0] = L->a[j]; s[1] = L->b[j]; s[2] = L->c[j]; s[3] = L->cnt[j];
    L->tc[L->id[j]] = L->tails[j];
    L->id[j] = -1;
}

/* the lanes' loop (the comment above); returns the number of chunks this call claimed */
__attribute__((target("avx2"))) static Py_ssize_t zig_lanes_avx2(Lanes *L, const uint64_t *k, const double *w,
                                                                   const double *f) {
    enum { STEPS = 256 }; /* steps between looks at the lanes' chunks: a dead lane's scratch row */
    double sink[STEPS];
    uint64_t kw[256][2] __attribute__((aligned(16))); /* {k[i], the bits of w[i]} */
    for (int i = 0; i < 256; i++) {
        kw[i][0] = k[i];
        memcpy(&kw[i][1], &w[i], sizeof(double));
    }
    int live = 0;
    for (int j = 0; j < DPOPT_ZIG_LANES; j++) live += lane_claim(L, j);
    const __m256i one = _mm256_set1_epi64x(1), low8 = _mm256_set1_epi64x(0xFF), bit8 = _mm256_set1_epi64x(0x100),
                  low52 = _mm256_set1_epi64x(0xFFFFFFFFFFFFFLL), exp52 = _mm256_set1_epi64x(0x4330000000000000LL);
    const __m256d two52 = _mm256_set1_pd(4503599627370496.0); /* 2^52 */
    while (live >= 2) {
        /* as many steps as the fullest live lane has values left (a lane stores at most one value a step) */
        Py_ssize_t steps = STEPS;
        int dead = 0;
        for (int j = 0; j < DPOPT_ZIG_LANES; j++) {
            if (L->id[j] < 0) {
                L->p[j] = sink, dead |= 1 << j;
            } else if (L->end[j] - L->p[j] < steps) {
                steps = L->end[j] - L->p[j];
            }
        }
        double *p0 = L->p[0], *p1 = L->p[1], *p2 = L->p[2], *p3 = L->p[3];
        __m256i a = _mm256_loadu_si256((const __m256i *)L->a), b = _mm256_loadu_si256((const __m256i *)L->b),
                c = _mm256_loadu_si256((const __m256i *)L->c), cnt = _mm256_loadu_si256((const __m256i *)L->cnt);
        for (Py_ssize_t s = 0; s < steps; s++) {
            /* SFC_STEP in each lane: t = a + b + counter++; a = b ^ (b >> 11); b = c + (c << 3);
             * c = rotl(c, 24) + t */
            __m256i t = _mm256_add_epi64(_mm256_add_epi64(a, b), cnt);
            cnt = _mm256_add_epi64(cnt, one);
            a = _mm256_xor_si256(b, _mm256_srli_epi64(b, 11));
            b = _mm256_add_epi64(c, _mm256_slli_epi64(c, 3));
            c = _mm256_add_epi64(_mm256_or_si256(_mm256_slli_epi64(c, 24), _mm256_srli_epi64(c, 40)), t);
            /* strip = t & 0xFF, rabs = bits 9..60 of t, x = (double)rabs * w[strip] (exact conversion: rabs < 2^52
             * under the exponent of 2^52 is the double 2^52 + rabs; minus 2^52 is exact), sign = bit 8 of t */
            __m256i strip = _mm256_and_si256(t, low8);
            __m256i rabs = _mm256_and_si256(_mm256_srli_epi64(t, 9), low52);
#ifdef ZIG_GATHER
            __m256i kv = _mm256_i64gather_epi64((const long long *)k, strip, 8);
            __m256d wv = _mm256_i64gather_pd(w, strip, 8);
#else
            /* k[strip] and w[strip] of each lane: one 16-byte load of its {k, w} entry (cheaper than two gathers
             * here), the four entries transposed by two unpacks */
            uint8_t tb[32];
            _mm256_storeu_si256((__m256i *)tb, t);
            __m256i e02 = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_load_si128((const __m128i *)kw[tb[0]])),
                                                  _mm_load_si128((const __m128i *)kw[tb[16]]), 1);
            __m256i e13 = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_load_si128((const __m128i *)kw[tb[8]])),
                                                  _mm_load_si128((const __m128i *)kw[tb[24]]), 1);
            __m256i kv = _mm256_unpacklo_epi64(e02, e13);
            __m256d wv = _mm256_castsi256_pd(_mm256_unpackhi_epi64(e02, e13));
#endif
            __m256d xr = _mm256_sub_pd(_mm256_castsi256_pd(_mm256_or_si256(rabs, exp52)), two52);
            __m256d x = _mm256_mul_pd(xr, wv);
            x = _mm256_or_pd(x, _mm256_castsi256_pd(_mm256_slli_epi64(_mm256_and_si256(t, bit8), 55)));
            /* the fast test rabs < k[strip] (both < 2^63: the signed compare is the unsigned one) */
            int pass = _mm256_movemask_pd(_mm256_castsi256_pd(_mm256_cmpgt_epi64(kv, rabs))) | dead;
#ifdef ZIG_NOSLOW
            pass = 0xF;
#endif
            if (pass == 0xF) {
                __m128d x01 = _mm256_castpd256_pd128(x), x23 = _mm256_extractf128_pd(x, 1);
                _mm_storel_pd(p0++, x01);
                _mm_storeh_pd(p1++, x01);
                _mm_storel_pd(p2++, x23);
                _mm_storeh_pd(p3++, x23);
                continue;
            }
            /* some lane failed the fast test. Every lane stores its x at its next position, and the lanes that passed
             * move past it; each failed lane goes through the rest of zig_loop's body (zig_slow), which overwrites
             * that position when it yields a value. The wedge test's word is one more SFC64 step of that lane: it
             * is made here in every lane, and kept (the lane's state advanced) only in the lanes that take it. */
            int fail = ~pass & 0xF, wedge = 0;
            __m256i t2 = _mm256_add_epi64(_mm256_add_epi64(a, b), cnt);
            uint64_t ts[DPOPT_ZIG_LANES], t2s[DPOPT_ZIG_LANES];
            _mm256_storeu_si256((__m256i *)ts, t);
            _mm256_storeu_si256((__m256i *)t2s, t2);
            for (int j = 0; j < DPOPT_ZIG_LANES; j++)
                if ((fail >> j & 1) && (ts[j] & 0xFF) != 0) wedge |= 1 << j;
            __m256i take = _mm256_loadu_si256((const __m256i *)lane_mask[wedge]);
            __m256i a2 = _mm256_xor_si256(b, _mm256_srli_epi64(b, 11)), b2 = _mm256_add_epi64(c, _mm256_slli_epi64(c, 3));
            __m256i c2 = _mm256_add_epi64(_mm256_or_si256(_mm256_slli_epi64(c, 24), _mm256_srli_epi64(c, 40)), t2);
            a = _mm256_blendv_epi8(a, a2, take);
            b = _mm256_blendv_epi8(b, b2, take);
            c = _mm256_blendv_epi8(c, c2, take);
            cnt = _mm256_sub_epi64(cnt, take); /* counter + 1 where taken (take = -1) */
            __m128d x01 = _mm256_castpd256_pd128(x), x23 = _mm256_extractf128_pd(x, 1);
            _mm_storel_pd(p0, x01);
            _mm_storeh_pd(p1, x01);
            _mm_storel_pd(p2, x23);
            _mm_storeh_pd(p3, x23);
            p0 += pass & 1, p1 += pass >> 1 & 1, p2 += pass >> 2 & 1, p3 += pass >> 3 & 1;
            double **ps[DPOPT_ZIG_LANES] = {&p0, &p1, &p2, &p3};
            for (int j = 0; j < DPOPT_ZIG_LANES; j++) {
                if (!(fail >> j & 1)) continue;
                double v, **pj = ps[j];
                int r = zig_slow(ts[j], t2s[j], k, w, f, &v);
                if (r == 2) { /* the tail branch: its position in the chunk, filled later by the caller */
                    if (L->tails[j] < L->cap) L->ti[L->id[j] * L->cap + L->tails[j]] = (int64_t)(*pj - L->start[j]);
                    L->tails[j]++;
                }
                if (r) *(*pj)++ = v;
            }
        }
        _mm256_storeu_si256((__m256i *)L->a, a);
        _mm256_storeu_si256((__m256i *)L->b, b);
        _mm256_storeu_si256((__m256i *)L->c, c);
        _mm256_storeu_si256((__m256i *)L->cnt, cnt);
        L->p[0] = p0, L->p[1] = p1, L->p[2] = p2, L->p[3] = p3;
        for (int j = 0; j < DPOPT_ZIG_LANES; j++) {
            if (L->id[j] >= 0 && L->p[j] == L->end[j]) {
                lane_store(L, j);
                live += lane_claim(L, j) - 1;
            }
        }
    }
    /* at most one lane left (no chunk to claim): zig_loop finishes its chunk from where the lane stopped */
    for (int j = 0; j < DPOPT_ZIG_LANES; j++) {
        if (L->id[j] < 0) continue;
        int64_t i = L->id[j];
        uint64_t *s = L->st + 4 * i;
        s[0] = L->a[j]; s[1] = L->b[j]; s[2] = L->c[j]; s[3] = L->cnt[j];
        L->tc[i] = zig_loop(L->start[j], L->p[j] - L->start[j], L->end[j] - L->start[j], s, 0, k, w, f,
                            L->ti + (Py_ssize_t)i * L->cap, L->cap, L->tails[j]);
        L->id[j] = -1;
    }
    return L->done;
}

/* whether this CPU runs the lanes (AVX2) */
static int zig_lanes_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2");
}
#endif

static PyObject *ziggurat_fill_chunks(PyObject *self, PyObject *args) {
    PyObject *o_out, *o_states, *o_next, *o_k, *o_w, *o_f, *o_tail, *o_count;
    Py_ssize_t chunk, discard, cap, lanes = 0;
    if (!PyArg_ParseTuple(args, "OOOnnOOOOnO|n", &o_out, &o_states, &o_next, &chunk, &discard, &o_k, &o_w, &o_f,
                          &o_tail, &cap, &o_count, &lanes))
        return NULL;
    Buffers bs = {.n = 0};
    PyObject *result = NULL;
    Py_buffer *out, *states, *next, *k, *w, *f, *tail, *count;
    if (!(out = take(&bs, o_out, 1, "out")) || !(states = take(&bs, o_states, 1, "states")) ||
        !(next = take(&bs, o_next, 1, "next")) || !(k = take(&bs, o_k, 0, "k")) || !(w = take(&bs, o_w, 0, "w")) ||
        !(f = take(&bs, o_f, 0, "f")) || !(tail = take(&bs, o_tail, 1, "tail_idx")) ||
        !(count = take(&bs, o_count, 1, "tail_count")))
        goto done;
    Py_ssize_t n = count_of(out);
    Py_ssize_t m = chunk > 0 ? n / chunk + (n % chunk != 0) : -1;
    if (kind_of(out) != 'd' || kind_of(states) != 'Q' || chunk <= 0 || count_of(states) != 4 * m ||
        kind_of(next) != 'q' || count_of(next) < 1 || kind_of(k) != 'Q' || count_of(k) != 256 ||
        kind_of(w) != 'd' || count_of(w) != 256 || kind_of(f) != 'd' || count_of(f) != 256 || kind_of(tail) != 'q' ||
        cap < 0 || (cap > 0 && m > PY_SSIZE_T_MAX / cap) || count_of(tail) != m * cap || kind_of(count) != 'q' ||
        count_of(count) != m || discard < 0) {
        PyErr_SetString(PyExc_ValueError,
                        "ziggurat_fill_chunks takes out float64 [n], states uint64 [ceil(n / chunk), 4], next int64 "
                        "[>= 1], chunk > 0, discard >= 0, k uint64 [256], w and f float64 [256], tail_idx int64 "
                        "[ceil(n / chunk), cap], cap >= 0, tail_count int64 [ceil(n / chunk)]");
        goto done;
    }
    Py_ssize_t done_here = 0;
    Py_BEGIN_ALLOW_THREADS
    double *o = (double *)out->buf;
    uint64_t *st = (uint64_t *)states->buf;
    int64_t *ti = (int64_t *)tail->buf, *tc = (int64_t *)count->buf;
    const int64_t *stop = count_of(next) >= 2 ? (const int64_t *)next->buf + 1 : NULL;
#ifdef DPOPT_ZIG_LANES
    /* the chunks in SIMD lanes where the CPU has them (lanes = 1: the scalar loop, for the tests) and every k < 2^63
     * (the lanes' signed compare); the same values, states and tail positions either way */
    int use_lanes = lanes != 1 && zig_lanes_supported();
    for (int j = 0; j < 256 && use_lanes; j++) use_lanes = ((const uint64_t *)k->buf)[j] < (1ULL << 63);
    if (use_lanes) {
        Lanes L = {.o = o, .st = st, .next = (int64_t *)next->buf, .ti = ti, .tc = tc, .stop = stop, .n = n, .m = m,
                   .chunk = chunk, .discard = discard, .cap = cap};
        done_here = zig_lanes_avx2(&L, (const uint64_t *)k->buf, (const double *)w->buf, (const double *)f->buf);
    }
    else
#endif
    for (;;) {
        if (stop && paused(stop)) break;
        int64_t i = claim((int64_t *)next->buf);
        if (i < 0 || i >= m) break;
        Py_ssize_t lo = (Py_ssize_t)i * chunk, len = n - lo < chunk ? n - lo : chunk;
        tc[i] = zig_loop(o + lo, 0, len, st + 4 * i, discard, (const uint64_t *)k->buf, (const double *)w->buf,
                         (const double *)f->buf, ti + (Py_ssize_t)i * cap, cap, 0);
        done_here++;
    }
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(done_here);
done:
    release_all(&bs);
    return result;
}

/* ---------------------------------------------------------------------------------------------- release */

/* out[i] = rnd(z[i]*scale + s[i]) / divisor  (divide)  or  rnd(z[i]*scale + s[i]): the float64 product and sum
 * rounded once each, the store rounds once to the result's type, the division in the result's type. */
#define RELEASE_LOOP(NAME, TOUT, TSUM)                                                                      \
    DPOPT_CLONES static void NAME(TOUT *out, const TSUM *s, const double *z, Py_ssize_t n, double scale,      \
                                  TOUT divisor, int divide) {                                               \
        if (divide) {                                                                                       \
            for (Py_ssize_t i = 0; i < n; i++) out[i] = (TOUT)(z[i] * scale + (double)s[i]) / divisor;      \
        } else {                                                                                            \
            for (Py_ssize_t i = 0; i < n; i++) out[i] = (TOUT)(z[i] * scale + (double)s[i]);                \
        }                                                                                                   \
    }

/* the same into s itself (out is s): a separate loop, so the compiler's vector loop needs no overlap check
 * between the output and the sum */
#define INPLACE_LOOP(NAME, T)                                                                               \
    DPOPT_CLONES static void NAME(T *s, const double *z, Py_ssize_t n, double scale, T divisor, int divide) { \
        if (divide) {                                                                                       \
            for (Py_ssize_t i = 0; i < n; i++) s[i] = (T)(z[i] * scale + (double)s[i]) / divisor;           \
        } else {                                                                                            \
            for (Py_ssize_t i = 0; i < n; i++) s[i] = (T)(z[i] * scale + (double)s[i]);                     \
        }                                                                                                   \
    }

RELEASE_LOOP(release_ff, float, float)
RELEASE_LOOP(release_dd, double, double)
RELEASE_LOOP(release_fd, float, double)
RELEASE_LOOP(release_df, double, float)
INPLACE_LOOP(release_ff_inplace, float)
INPLACE_LOOP(release_dd_inplace, double)

PyDoc_STRVAR(release_doc,
"release(out, s, z, scale, divisor, divide) -> None\n\n"
"out[i] = rnd(z[i]*scale + s[i]) / divisor (or without the division when divide is false): out and s float32\n"
"or float64 [n] (out may be s itself: the same elements), z float64 [n] overlapping neither, divisor rounded\n"
"to out's type. ValueError for any other overlap, type or length. GIL released.");

static PyObject *release(PyObject *self, PyObject *args) {
    PyObject *o_out, *o_s, *o_z;
    double scale, divisor;
    int divide;
    if (!PyArg_ParseTuple(args, "OOOddp", &o_out, &o_s, &o_z, &scale, &divisor, &divide)) return NULL;
    Buffers bs = {.n = 0};
    PyObject *result = NULL;
    Py_buffer *out, *s, *z;
    if (!(out = take(&bs, o_out, 1, "out")) || !(s = take(&bs, o_s, 0, "s")) || !(z = take(&bs, o_z, 0, "z")))
        goto done;
    char ko = kind_of(out), ks = kind_of(s);
    Py_ssize_t n = count_of(out);
    if ((ko != 'f' && ko != 'd') || (ks != 'f' && ks != 'd') || kind_of(z) != 'd' || count_of(s) != n ||
        count_of(z) != n) {
        PyErr_SetString(PyExc_ValueError, "release takes out and s float32 or float64 [n] and z float64 [n] of one length");
        goto done;
    }
    const char *ob = (const char *)out->buf, *sb = (const char *)s->buf, *zb = (const char *)z->buf;
    int inplace = ob == sb && ko == ks; /* the same elements: the sum is overwritten by its release */
    if ((!inplace && ob < sb + s->len && sb < ob + out->len) || (zb < ob + out->len && ob < zb + z->len)) {
        PyErr_SetString(PyExc_ValueError, "release: out overlaps s (without being s itself) or z");
        goto done;
    }
    const double *zp = (const double *)z->buf;
    Py_BEGIN_ALLOW_THREADS
    if (inplace && ko == 'f') release_ff_inplace((float *)out->buf, zp, n, scale, (float)divisor, divide);
    else if (inplace) release_dd_inplace((double *)out->buf, zp, n, scale, divisor, divide);
    else if (ko == 'f' && ks == 'f') release_ff((float *)out->buf, (const float *)s->buf, zp, n, scale, (float)divisor, divide);
    else if (ko == 'f') release_fd((float *)out->buf, (const double *)s->buf, zp, n, scale, (float)divisor, divide);
    else if (ks == 'f') release_df((double *)out->buf, (const float *)s->buf, zp, n, scale, divisor, divide);
    else release_dd((double *)out->buf, (const double *)s->buf, zp, n, scale, divisor, divide);
    Py_END_ALLOW_THREADS
    Py_INCREF(Py_None);
    result = Py_None;
done:
    release_all(&bs);
    return result;
}

/* -------------------------------------------------------------------------------------------- row norms */

/* out[r] = sum_j float64(x[r, j])^2 for lo <= r < hi: eight float64 accumulators over the columns j = 0..7 mod 8
 * of the first n - n mod 8 columns, added ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)), then the last
 * n mod 8 squares left to right. A float32 value's square is exact in float64; only the additions round. */
DPOPT_CLONES static void row_loop(const float *x, Py_ssize_t n, double *out, Py_ssize_t lo, Py_ssize_t hi) {
    Py_ssize_t m = n - n % 8;
    for (Py_ssize_t r = lo; r < hi; r++) {
        const float *row = x + r * n;
        double a0 = 0.0, a1 = 0.0, a2 = 0.0, a3 = 0.0, a4 = 0.0, a5 = 0.0, a6 = 0.0, a7 = 0.0;
        for (Py_ssize_t j = 0; j < m; j += 8) {
            double v0 = row[j], v1 = row[j + 1], v2 = row[j + 2], v3 = row[j + 3];
            double v4 = row[j + 4], v5 = row[j + 5], v6 = row[j + 6], v7 = row[j + 7];
            a0 += v0 * v0; a1 += v1 * v1; a2 += v2 * v2; a3 += v3 * v3;
            a4 += v4 * v4; a5 += v5 * v5; a6 += v6 * v6; a7 += v7 * v7;
        }
        double total = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7));
        for (Py_ssize_t j = m; j < n; j++) {
            double v = row[j];
            total += v * v;
        }
        out[r] = total;
    }
}

PyDoc_STRVAR(row_sq_norms64_doc,
"row_sq_norms64(x, out, columns, lo, hi) -> None\n\n"
"out[r] = sum_j float64(x[r, j])^2 for lo <= r < hi: x float32 [rows, columns] C-contiguous, out float64\n"
"[rows]; the order of the additions is fixed by `columns` alone. GIL released.");

static PyObject *row_sq_norms64(PyObject *self, PyObject *args) {
    PyObject *o_x, *o_out;
    Py_ssize_t columns, lo, hi;
    if (!PyArg_ParseTuple(args, "OOnnn", &o_x, &o_out, &columns, &lo, &hi)) return NULL;
    Buffers bs = {.n = 0};
    PyObject *result = NULL;
    Py_buffer *x, *out;
    if (!(x = take(&bs, o_x, 0, "x")) || !(out = take(&bs, o_out, 1, "out"))) goto done;
    Py_ssize_t rows = count_of(out);
    /* rows * columns compared without overflow: a huge `columns` must not wrap to x's length */
    if (kind_of(x) != 'f' || kind_of(out) != 'd' || columns < 0 || (columns > 0 && rows > PY_SSIZE_T_MAX / columns) ||
        count_of(x) != rows * columns || lo < 0 || hi > rows || lo > hi) {
        PyErr_SetString(PyExc_ValueError,
                        "row_sq_norms64 takes x float32 [rows, columns], out float64 [rows], 0 <= lo <= hi <= rows");
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    row_loop((const float *)x->buf, columns, (double *)out->buf, lo, hi);
    Py_END_ALLOW_THREADS
    Py_INCREF(Py_None);
    result = Py_None;
done:
    release_all(&bs);
    return result;
}

/* ------------------------------------------------------------------------- norms rounded up, clip factors */

/* x rounded toward +inf into float32 (the cast rounds to nearest: up to half an ulp below x). nan stays nan,
 * +-inf stay, a finite x above FLT_MAX gives +inf: the values of dpopt.engine.shifted_norm.round_up. */
static inline float round_up_f(double x) {
    float f = (float)x;
    if ((double)f < x) f = nextafterf(f, INFINITY);
    return f;
}

/* x rounded toward -inf into float32; a finite x above FLT_MAX gives FLT_MAX: dpopt.privatizer._round_down */
static inline float round_down_f(double x) {
    float f = (float)x;
    if ((double)f > x) f = nextafterf(f, -INFINITY);
    return f;
}

PyDoc_STRVAR(sq_round_up_doc,
"sq_round_up(out, x, y, factor) -> None\n\n"
"out[i] = round_up_f32((x[i] * y[i]) * factor), or round_up_f32(x[i] * factor) when y is None: x, y float64\n"
"[n], out float32 [n]; each product one float64 rounding (to nearest), then one rounding toward +inf.");

static PyObject *sq_round_up(PyObject *self, PyObject *args) {
    PyObject *o_out, *o_x, *o_y;
    double factor;
    if (!PyArg_ParseTuple(args, "OOOd", &o_out, &o_x, &o_y, &factor)) return NULL;
    Buffers bs = {.n = 0};
    PyObject *result = NULL;
    Py_buffer *out, *x, *y = NULL;
    if (!(out = take(&bs, o_out, 1, "out")) || !(x = take(&bs, o_x, 0, "x"))) goto done;
    if (o_y != Py_None && !(y = take(&bs, o_y, 0, "y"))) goto done;
    Py_ssize_t n = count_of(out);
    if (kind_of(out) != 'f' || kind_of(x) != 'd' || count_of(x) != n || (y && (kind_of(y) != 'd' || count_of(y) != n))) {
        PyErr_SetString(PyExc_ValueError, "sq_round_up takes out float32 [n], x float64 [n] and y float64 [n] or None");
        goto done;
    }
    float *o = (float *)out->buf;
    const double *xp = (const double *)x->buf;
    if (y) {
        const double *yp = (const double *)y->buf;
        for (Py_ssize_t i = 0; i < n; i++) o[i] = round_up_f((xp[i] * yp[i]) * factor);
    } else {
        for (Py_ssize_t i = 0; i < n; i++) o[i] = round_up_f(xp[i] * factor);
    }
    Py_INCREF(Py_None);
    result = Py_None;
done:
    release_all(&bs);
    return result;
}

PyDoc_STRVAR(sq_group_totals_doc,
"sq_group_totals(out, pieces, groups, factor, total) -> bool\n\n"
"total[b, g] = 0 + v_0[b] + v_1[b] + ... over the pieces v_k (float32 [B]) with groups[k] == g, in the order\n"
"given, each addition in float64 (each float32 term exact there); then out[b, g] = round_up_f32(total[b, g] *\n"
"factor). out float32 [B, G], total float64 [B, G] (scratch, kept: the caller reads it when a total is not\n"
"finite), groups a sequence of ints in [0, G). Returns True when every total is finite.");

static PyObject *sq_group_totals(PyObject *self, PyObject *args) {
    PyObject *o_out, *o_pieces, *o_groups, *o_total;
    double factor;
    if (!PyArg_ParseTuple(args, "OOOdO", &o_out, &o_pieces, &o_groups, &factor, &o_total)) return NULL;
    Buffers bs = {.n = 0};
    PyObject *result = NULL, *pieces = NULL, *groups = NULL;
    Py_buffer *out, *total;
    if (!(out = take(&bs, o_out, 1, "out")) || !(total = take(&bs, o_total, 1, "total"))) goto done;
    if (!(pieces = PySequence_Fast(o_pieces, "pieces must be a sequence")) ||
        !(groups = PySequence_Fast(o_groups, "groups must be a sequence")))
        goto done;
    Py_ssize_t k = PySequence_Fast_GET_SIZE(pieces), cells = count_of(out);
    Py_ssize_t nb = out->ndim == 2 ? out->shape[0] : -1, ng = out->ndim == 2 ? out->shape[1] : -1;
    if (kind_of(out) != 'f' || kind_of(total) != 'd' || nb < 0 || count_of(total) != cells ||
        PySequence_Fast_GET_SIZE(groups) != k) {
        PyErr_SetString(PyExc_ValueError,
                        "sq_group_totals takes out float32 [B, G], total float64 [B, G] and one group per piece");
        goto done;
    }
    double *t = (double *)total->buf;
    for (Py_ssize_t c = 0; c < cells; c++) t[c] = 0.0;
    for (Py_ssize_t j = 0; j < k; j++) {
        Py_ssize_t g = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(groups, j));
        if (g == -1 && PyErr_Occurred()) goto done;
        if (g < 0 || g >= ng) {
            PyErr_SetString(PyExc_ValueError, "sq_group_totals: a group index is outside [0, G)");
            goto done;
        }
        Py_buffer v;
        if (get_buffer(PySequence_Fast_GET_ITEM(pieces, j), &v, 0, "a piece") < 0) goto done;
        if (kind_of(&v) != 'f' || count_of(&v) != nb) {
            PyBuffer_Release(&v);
            PyErr_SetString(PyExc_ValueError, "sq_group_totals: every piece must be float32 [B]");
            goto done;
        }
        const float *vp = (const float *)v.buf;
        for (Py_ssize_t b = 0; b < nb; b++) t[b * ng + g] += (double)vp[b];
        PyBuffer_Release(&v);
    }
    int finite = 1;
    float *o = (float *)out->buf;
    for (Py_ssize_t c = 0; c < cells; c++) {
        finite &= isfinite(t[c]) ? 1 : 0;
        o[c] = round_up_f(t[c] * factor);
    }
    result = PyBool_FromLong(finite);
done:
    Py_XDECREF(pieces);
    Py_XDECREF(groups);
    release_all(&bs);
    return result;
}

PyDoc_STRVAR(clip_factors32_doc,
"clip_factors32(out, sq, bounds, squares, margin) -> None\n\n"
"out[b, g] = 1 where S <= squares[g], else round_down_f32(q) with q = (bounds[g] / sqrt(S)) * margin set to 0\n"
"below 2^-1022 (S = float64(sq[b, g])): sq and out float32 [B, G], bounds and squares float64 [G].");

static PyObject *clip_factors32(PyObject *self, PyObject *args) {
    PyObject *o_out, *o_sq, *o_b, *o_c2;
    double margin;
    if (!PyArg_ParseTuple(args, "OOOOd", &o_out, &o_sq, &o_b, &o_c2, &margin)) return NULL;
    Buffers bs = {.n = 0};
    PyObject *result = NULL;
    Py_buffer *out, *sq, *bd, *c2;
    if (!(out = take(&bs, o_out, 1, "out")) || !(sq = take(&bs, o_sq, 0, "sq")) || !(bd = take(&bs, o_b, 0, "bounds")) ||
        !(c2 = take(&bs, o_c2, 0, "squares")))
        goto done;
    Py_ssize_t ng = sq->ndim == 2 ? sq->shape[1] : -1, cells = count_of(sq);
    if (kind_of(out) != 'f' || kind_of(sq) != 'f' || kind_of(bd) != 'd' || kind_of(c2) != 'd' || ng < 0 ||
        count_of(out) != cells || count_of(bd) != ng || count_of(c2) != ng) {
        PyErr_SetString(PyExc_ValueError,
                        "clip_factors32 takes out and sq float32 [B, G], bounds and squares float64 [G]");
        goto done;
    }
    const float *s = (const float *)sq->buf;
    const double *bp = (const double *)bd->buf, *cp = (const double *)c2->buf;
    float *o = (float *)out->buf;
    for (Py_ssize_t c = 0; c < cells; c++) {
        Py_ssize_t g = c % ng;
        double v = (double)s[c];
        double q = (bp[g] / sqrt(v)) * margin;
        if (q < 0x1p-1022) q = 0.0; /* subnormal or negative: 0 (nan stays nan) */
        o[c] = v <= cp[g] ? 1.0f : round_down_f(q);
    }
    Py_INCREF(Py_None);
    result = Py_None;
done:
    release_all(&bs);
    return result;
}

/* -------------------------------------------------------------------------------------------------- module */

static PyMethodDef methods[] = {
    {"ziggurat_fill", ziggurat_fill, METH_VARARGS, ziggurat_fill_doc},
    {"ziggurat_fill_chunks", ziggurat_fill_chunks, METH_VARARGS, ziggurat_fill_chunks_doc},
    {"release", release, METH_VARARGS, release_doc},
    {"row_sq_norms64", row_sq_norms64, METH_VARARGS, row_sq_norms64_doc},
    {"sq_round_up", sq_round_up, METH_VARARGS, sq_round_up_doc},
    {"sq_group_totals", sq_group_totals, METH_VARARGS, sq_group_totals_doc},
    {"clip_factors32", clip_factors32, METH_VARARGS, clip_factors32_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "dpopt._native",
    "dpopt's CPU kernels (the sampler's ziggurat, the release pass, float64 row norms, norms rounded up, clip factors), built with the package.",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
