/* dpopt._native: the CPU kernels of dpopt, compiled once when the package is built.
 *
 *   ziggurat_fill   the body of the CPU Gaussian sampler (dpopt.ziggurat: Marsaglia & Tsang 2000 on SFC64);
 *                   one scalar loop (zig_loop) per SFC64 stream, its fast path a lookup of k and the signed w by
 *                   the word's 9 low bits (strip and sign bit: zig_tables), one product and one compare
 *   fill_tails      the tail branch's positions: exact draws of Z | Z >= r (Marsaglia 1964) from the same stream
 *   ziggurat_fill_chunks  body and tails on the chunks of a whole draw, claimed by the calling threads (dpopt.noise)
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
#include <stdlib.h>
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

/* The fast path's tables, indexed by the 9 low bits of a word (bits 0-7: the strip, bit 8: the sign bit):
 * k9[sign << 8 | strip] = k[strip] and w9[sign << 8 | strip] = w[strip] with the sign bit `sign` set. Then
 * x = rabs * w9[idx] is bit for bit with_sign(rabs * w[strip], sign), the value zig_loop stored before these
 * tables (2026-12-07): an IEEE product's sign is the xor of its factors' signs and its rounded magnitude does not
 * depend on them (rabs >= 0; rabs = 0 gives -0.0 under the sign bit either way). The loop no longer extracts the
 * sign bit and ORs it into x through an integer register: ≈ 24 instead of ≈ 28 instructions a normal, ≈ 11 % less
 * CPU time (docs/performance.md, "The compiled ziggurat"). 8 KiB, built per call (512 entries: < 1 µs). */
typedef struct {
    uint64_t k9[512];
    double w9[512];
} ZigTables;

static void zig_tables(ZigTables *e, const uint64_t *k, const double *w) {
    for (int i = 0; i < 512; i++) {
        e->k9[i] = k[i & 0xFF];
        e->w9[i] = with_sign(w[i & 0xFF], (uint64_t)(i >> 8) << 63);
    }
}

/* the body on out[0, n) (e: zig_tables of the tables k, w); the first `cap` tail positions go to tail_idx; returns
 * the number of tail positions */
static Py_ssize_t zig_loop(double *out, Py_ssize_t n, uint64_t *s, Py_ssize_t discard, const ZigTables *e,
                           const double *f, int64_t *tail_idx, Py_ssize_t cap) {
    uint64_t a = s[0], b = s[1], c = s[2], n_ = s[3], tmp;
    const double to_unit = 1.0 / 9007199254740992.0; /* 2^-53 */
    Py_ssize_t tails = 0, i = 0;
    for (Py_ssize_t d = 0; d < discard; d++) SFC_STEP(tmp);
    while (i < n) {
        SFC_STEP(tmp);
        unsigned idx = (unsigned)(tmp & 0x1FF); /* strip = bits 0-7 of the word, its sign bit 8 */
        uint64_t rabs = (tmp >> 9) & 0xFFFFFFFFFFFFFULL;
        double x = (double)(int64_t)rabs * e->w9[idx]; /* with its sign; rabs < 2^52: the signed conversion is exact */
        if (rabs < e->k9[idx]) {
            out[i++] = x;
            continue;
        }
        unsigned strip = (unsigned)(tmp & 0xFF);
        if (strip == 0) { /* the tail branch: filled by the caller */
            if (tails < cap) tail_idx[tails] = (int64_t)i;
            tails++;
            out[i++] = with_sign(INFINITY, (tmp & 0x100) << 55);
            continue;
        }
        SFC_STEP(tmp);
        double u = (double)(int64_t)(tmp >> 11) * to_unit; /* < 2^53: exact */
        /* x carries its sign: -0.5 * x * x, i.e. (-0.5 * x) * x, is the same double for x and -x */
        if (f[strip] + u * (f[strip - 1] - f[strip]) < exp(-0.5 * x * x)) out[i++] = x;
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
    ZigTables e; /* 8 KiB on the calling thread's stack */
    zig_tables(&e, (const uint64_t *)k->buf, (const double *)w->buf);
    tails = zig_loop((double *)out->buf, n, (uint64_t *)state->buf, discard, &e, (const double *)f->buf,
                     (int64_t *)tail->buf, n);
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(tails);
done:
    release_all(&bs);
    return result;
}

/* ------------------------------------------------------------------------------------- the tail's exact law */

/* The draws of Z | Z >= r at the tail branch's positions (dpopt.noise, "the CPU sampler"): Marsaglia (1964) on
 * uniforms with the full float64 exponent range, in rounds, from the chunk's own SFC64 stream where its body
 * stopped. One round for `want` draws proposes t = want + want/4 + 4 candidates and takes words in this order:
 * t pairs (w0, w1), candidate j's u1 = mu_j * 2^-(k_j + 1) with mu_j = the float64 in [1, 2) of w1's 52 high bits
 * and k_j = the leading zero bits of w0 with its 11 low bits cleared; for each candidate (in order) whose masked w0
 * is 0 (probability 2^-53), TAIL_WORDS - 1 further words, k_j then counting over the 1024-bit stream of the
 * unmasked w0 and those words (64 * TAIL_WORDS when all are zero); then t words of u2 = (w >> 11) * 2^-53. With
 * k capped at TAIL_K_MAX: z = sqrt(r*r - 2 * (log(mu) - (k + 1) * ln 2)), accepted when u2 * z < r; the first
 * `want` accepted candidates are kept, in order, and a round follows while draws are missing. Every |z| <=
 * sqrt(r^2 + 2 * (TAIL_K_MAX + 1) * ln 2) = 37.63. The same rounds, words and float64 expressions as the numpy
 * statement of the law in tests/core/tail_oracle.py, whose log (numpy's vectorised one) may differ from libm's by
 * one ulp (tests/core/test_tail_kernel.py). */
#define TAIL_WORDS 16   /* words of the geometric stream of a tail uniform's exponent: 1024 bits */
#define TAIL_K_MAX 1011 /* the exponent cap: sqrt(r^2 + 2 (K + 1) ln 2) <= dpopt.noise.CUT_RADIUS */
#define LN2 0.6931471805599453 /* math.log(2.0), the double nearest ln 2 */
/* the tail's start r the kernels take: finite and in [1, 1000] (dpopt's r is 3.654). Below 1 a candidate is
 * accepted with probability ~r, above it r*r may overflow: either could loop for ever with the GIL released. */
#define TAIL_R_MIN 1.0
#define TAIL_R_MAX 1000.0

static int tail_r_ok(double r) { return r >= TAIL_R_MIN && r <= TAIL_R_MAX; } /* false for nan and inf */

/* zero n bytes in a way the compiler cannot drop as a dead store (the tails' scratch holds raw stream words,
 * from which SFC64, a bijection, runs back to the chunk's secret state) */
static void wipe(void *p, size_t n) {
    volatile unsigned char *q = (volatile unsigned char *)p;
    while (n--) *q++ = 0;
}

/* whether two buffers share a byte */
static int overlap(const Py_buffer *x, const Py_buffer *y) {
    const char *a = (const char *)x->buf, *b = (const char *)y->buf;
    return x->len > 0 && y->len > 0 && a < b + y->len && b < a + x->len;
}

typedef struct {
    uint64_t first; /* w0, kept for a rare candidate's leading-zero count */
    int64_t zeros;  /* k, or -1 until a rare candidate's further words are drawn */
    double mant;    /* mu */
    double z;
} TailCandidate;

static inline int64_t leading_zeros64(uint64_t w) { /* w != 0 */
#if defined(__GNUC__) || defined(__clang__)
    return (int64_t)__builtin_clzll(w);
#else
    int64_t k = 0;
    while (!(w >> 63)) {
        w <<= 1;
        k++;
    }
    return k;
#endif
}

/* m draws of Z | Z >= r into z[0, m) from the SFC64 state s (advanced in place); scratch: room for `room`
 * candidates (grown with realloc; *scratch may be NULL). Returns 0, or -1 out of memory. No GIL needed. */
static int tail_draws(uint64_t *s, Py_ssize_t m, double r, double *z, TailCandidate **scratch, Py_ssize_t *room) {
    uint64_t a = s[0], b = s[1], c = s[2], n_ = s[3], w0, w1;
    const double r2 = r * r, to_unit = 1.0 / 9007199254740992.0; /* 2^-53 */
    const uint64_t hi_mask = ~(uint64_t)0x7FF, one = (uint64_t)1023 << 52;
    Py_ssize_t done = 0;
    while (done < m) {
        Py_ssize_t want = m - done, t = want + want / 4 + 4;
        if (t > *room) {
            if ((size_t)t > SIZE_MAX / sizeof(TailCandidate)) return -1;
            TailCandidate *grown = (TailCandidate *)realloc(*scratch, (size_t)t * sizeof(TailCandidate));
            if (!grown) return -1;
            *scratch = grown;
            *room = t;
        }
        TailCandidate *cand = *scratch;
        for (Py_ssize_t j = 0; j < t; j++) {
            SFC_STEP(w0);
            SFC_STEP(w1);
            uint64_t top = w0 & hi_mask, mbits = (w1 >> 12) | one;
            cand[j].first = w0;
            cand[j].zeros = top ? leading_zeros64(top) : -1;
            memcpy(&cand[j].mant, &mbits, sizeof mbits);
        }
        for (Py_ssize_t j = 0; j < t; j++) { /* the rare candidates' further words, in candidate order */
            if (cand[j].zeros >= 0) continue;
            int64_t zeros = cand[j].first ? leading_zeros64(cand[j].first) : -1;
            for (int q = 1; q < TAIL_WORDS; q++) {
                SFC_STEP(w1);
                if (zeros < 0 && w1) zeros = 64 * (int64_t)q + leading_zeros64(w1);
            }
            cand[j].zeros = zeros < 0 ? 64 * TAIL_WORDS : zeros;
        }
        for (Py_ssize_t j = 0; j < t; j++) {
            int64_t k = cand[j].zeros < TAIL_K_MAX ? cand[j].zeros : TAIL_K_MAX;
            cand[j].z = sqrt(r2 - 2.0 * (log(cand[j].mant) - (double)(k + 1) * LN2));
        }
        for (Py_ssize_t j = 0; j < t; j++) { /* all t words of u2 are drawn, however many are kept */
            SFC_STEP(w1);
            double u2 = (double)(int64_t)(w1 >> 11) * to_unit; /* < 2^53: exact */
            if (done < m && u2 * cand[j].z < r) z[done++] = cand[j].z;
        }
    }
    s[0] = a; s[1] = b; s[2] = c; s[3] = n_;
    return 0;
}

/* out[idx[j]] = tail draw j with the sign out[idx[j]] holds (the body's +-inf), j < m, out of n values, from the
 * state s (advanced in place); draws: room for m doubles. Each position is read once and checked where it is used
 * (the caller checked them too, but idx may share memory with out or change under another thread). Returns 0, -1
 * out of memory, -2 a position outside out. */
static int fill_tail_positions(double *out, Py_ssize_t n, const int64_t *idx, Py_ssize_t m, uint64_t *s, double r,
                               double *draws, TailCandidate **scratch, Py_ssize_t *room) {
    if (tail_draws(s, m, r, draws, scratch, room) != 0) return -1;
    for (Py_ssize_t j = 0; j < m; j++) {
        int64_t at = idx[j];
        if (at < 0 || at >= n) return -2;
        out[at] = copysign(draws[j], out[at]);
    }
    return 0;
}

/* the scratch of the tail draws wiped and freed */
static void free_tail_scratch(double *draws, Py_ssize_t n_draws, TailCandidate *scratch, Py_ssize_t room) {
    if (draws) wipe(draws, (size_t)n_draws * sizeof(double));
    if (scratch) wipe(scratch, (size_t)room * sizeof(TailCandidate));
    free(draws);
    free(scratch);
}

PyDoc_STRVAR(fill_tails_doc,
"fill_tails(out, state, idx, r) -> None\n\n"
"out[idx[j]] = the j-th draw of Z | Z >= r from the SFC64 stream state (uint64 [4], advanced in place), with the\n"
"sign out[idx[j]] holds: out float64 [n], idx int64 [m] (each 0 <= idx[j] < n), r finite in [1, 1000], the three\n"
"sharing no memory. The tail law's rounds and word order: the comment above tail_draws in _native.c. ValueError\n"
"for other shapes, types, positions, r or overlaps; MemoryError. GIL released.");

static PyObject *fill_tails(PyObject *self, PyObject *args) {
    PyObject *o_out, *o_state, *o_idx;
    double r;
    if (!PyArg_ParseTuple(args, "OOOd", &o_out, &o_state, &o_idx, &r)) return NULL;
    Buffers bs = {.n = 0};
    PyObject *result = NULL;
    Py_buffer *out, *state, *idx;
    if (!(out = take(&bs, o_out, 1, "out")) || !(state = take(&bs, o_state, 1, "state")) ||
        !(idx = take(&bs, o_idx, 0, "idx")))
        goto done;
    Py_ssize_t n = count_of(out), m = count_of(idx);
    if (kind_of(out) != 'd' || kind_of(state) != 'Q' || count_of(state) != 4 || kind_of(idx) != 'q' || !tail_r_ok(r)) {
        PyErr_SetString(PyExc_ValueError,
                        "fill_tails takes out float64 [n], state uint64 [4], idx int64 [m], r finite in [1, 1000]");
        goto done;
    }
    if (overlap(out, idx) || overlap(out, state) || overlap(idx, state)) {
        PyErr_SetString(PyExc_ValueError, "fill_tails: out, state and idx must not share memory");
        goto done;
    }
    const int64_t *ip = (const int64_t *)idx->buf;
    for (Py_ssize_t j = 0; j < m; j++) {
        if (ip[j] < 0 || ip[j] >= n) {
            PyErr_SetString(PyExc_ValueError, "fill_tails: a position in idx is outside out");
            goto done;
        }
    }
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
    TailCandidate *scratch = NULL;
    Py_ssize_t room = 0;
    double *draws = (double *)malloc((size_t)(m > 0 ? m : 1) * sizeof(double));
    failed = !draws ? -1 : fill_tail_positions((double *)out->buf, n, ip, m, (uint64_t *)state->buf, r, draws, &scratch, &room);
    free_tail_scratch(draws, m > 0 ? m : 1, scratch, room);
    Py_END_ALLOW_THREADS
    if (failed == -2) {
        PyErr_SetString(PyExc_ValueError, "fill_tails: a position in idx changed while the kernel ran");
        goto done;
    }
    if (failed) {
        PyErr_NoMemory();
        goto done;
    }
    Py_INCREF(Py_None);
    result = Py_None;
done:
    release_all(&bs);
    return result;
}

PyDoc_STRVAR(ziggurat_fill_chunks_doc,
"ziggurat_fill_chunks(out, states, next, chunk, discard, k, w, f, tail_idx, cap, tail_count, r=0) -> int\n\n"
"ziggurat_fill on the chunks of float64 out [n] (chunk i: out[i*chunk : min(n, (i+1)*chunk)], its stream the\n"
"i-th row of states uint64 [m, 4], m = ceil(n / chunk), advanced in place), each chunk claimed by an atomic\n"
"increment of next[0] (int64): callers in several threads share the chunks, each filled exactly once; where next\n"
"has a second element, a call stops claiming once next[1] is non-zero (a pause: the chunks it left stay unclaimed\n"
"for a later call). Chunk\n"
"i's first cap tail positions (relative to its start) go to row i of tail_idx (int64 [m, cap]), their number\n"
"(which may exceed cap: the caller then redraws the chunk) to tail_count[i] (int64 [m]). With r > 0 (the tail's\n"
"start, dpopt.ziggurat.ZIGGURAT_R; finite in [1, 1000]) a chunk with at most cap of them gets its tail draws there\n"
"at once (fill_tails from a copy of the state where its body stopped: states row i still ends there); r = 0 leaves\n"
"them +-inf. out shares no memory with states, next, tail_idx or tail_count. Returns the number of chunks this\n"
"call filled. GIL released throughout; ValueError, MemoryError.");

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

static PyObject *ziggurat_fill_chunks(PyObject *self, PyObject *args) {
    PyObject *o_out, *o_states, *o_next, *o_k, *o_w, *o_f, *o_tail, *o_count;
    Py_ssize_t chunk, discard, cap;
    double r = 0.0;
    if (!PyArg_ParseTuple(args, "OOOnnOOOOnO|d", &o_out, &o_states, &o_next, &chunk, &discard, &o_k, &o_w, &o_f,
                          &o_tail, &cap, &o_count, &r))
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
        count_of(count) != m || discard < 0 || !(r == 0.0 || tail_r_ok(r))) {
        PyErr_SetString(PyExc_ValueError,
                        "ziggurat_fill_chunks takes out float64 [n], states uint64 [ceil(n / chunk), 4], next int64 "
                        "[>= 1], chunk > 0, discard >= 0, k uint64 [256], w and f float64 [256], tail_idx int64 "
                        "[ceil(n / chunk), cap], cap >= 0, tail_count int64 [ceil(n / chunk)], r = 0 or finite in [1, 1000]");
        goto done;
    }
    if (overlap(out, states) || overlap(out, next) || overlap(out, tail) || overlap(out, count) ||
        overlap(tail, states) || overlap(tail, count) || overlap(tail, next)) {
        PyErr_SetString(PyExc_ValueError,
                        "ziggurat_fill_chunks: out, states, next, tail_idx and tail_count must not share memory");
        goto done;
    }
    Py_ssize_t done_here = 0;
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
    TailCandidate *scratch = NULL;
    Py_ssize_t room = 0;
    double *draws = cap > 0 && r > 0.0 ? (double *)malloc((size_t)cap * sizeof(double)) : NULL;
    double *o = (double *)out->buf;
    uint64_t *st = (uint64_t *)states->buf;
    int64_t *ti = (int64_t *)tail->buf, *tc = (int64_t *)count->buf;
    const int64_t *stop = count_of(next) >= 2 ? (const int64_t *)next->buf + 1 : NULL;
    ZigTables e; /* 8 KiB on the calling thread's stack */
    zig_tables(&e, (const uint64_t *)k->buf, (const double *)w->buf);
    for (;;) {
        if (stop && paused(stop)) break;
        int64_t i = claim((int64_t *)next->buf);
        if (i < 0 || i >= m) break;
        Py_ssize_t lo = (Py_ssize_t)i * chunk, len = n - lo < chunk ? n - lo : chunk;
        int64_t *at = ti + (Py_ssize_t)i * cap;
        tc[i] = zig_loop(o + lo, len, st + 4 * i, discard, &e, (const double *)f->buf, at, cap);
        done_here++;
        if (r > 0.0 && tc[i] > 0 && tc[i] <= cap) { /* the tails now, from a copy of the state where the body stopped */
            uint64_t after[4] = {st[4 * i], st[4 * i + 1], st[4 * i + 2], st[4 * i + 3]};
            failed = !draws ? -1 : fill_tail_positions(o + lo, len, at, (Py_ssize_t)tc[i], after, r, draws, &scratch, &room);
            wipe(after, sizeof after);
            if (failed) break;
        }
    }
    free_tail_scratch(draws, cap, scratch, room);
    Py_END_ALLOW_THREADS
    if (failed == -2) {
        PyErr_SetString(PyExc_ValueError, "ziggurat_fill_chunks: a recorded tail position changed while the kernel ran");
        goto done;
    }
    if (failed) {
        PyErr_NoMemory();
        goto done;
    }
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
    {"fill_tails", fill_tails, METH_VARARGS, fill_tails_doc},
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
