/* A built page (page_cols.h) written as a Parquet row group, in the layout pyarrow writes for
 * ``ROLLOUT_SCHEMA`` (server/export/columnar.py) with the export's options: every column PLAIN, data pages
 * v1 with RLE/bit-packed levels, compressed by zstd (level 1, Arrow's default), statistics (null count,
 * min, max) for the top-level columns only. It is handed over as the parts of a
 * server/export/parquet_pages.py ``PageFile``: the column chunks and the row group's metadata with its
 * offsets left open; the file's own metadata (schema, Arrow schema) is the footer pyarrow writes.
 *
 * pyarrow's writer derives each value's levels from the Arrow arrays one value at a time (and keeps level
 * histograms): about 40 us per rollout here, most of a Parquet export's time. The pages' structure is
 * known here, so levels are written as runs: a list of n token ids is two runs, whatever n.
 *
 * zstd is the system's libzstd, found at run time (dlopen): without it this returns None and the caller
 * writes the page with pyarrow. */
#include <dlfcn.h>
#include <math.h>

#include "page_cols.h"

/* --- zstd ----------------------------------------------------------------------------------------- */

typedef size_t (*CompressCCtx)(void *, void *, size_t, const void *, size_t, int);
static struct {
    int tried;
    void *cctx;
    size_t (*bound)(size_t);
    unsigned (*is_error)(size_t);
    CompressCCtx compress;
} Z;

static int zstd_ready(void) {
    if (Z.tried) return Z.compress != NULL;
    Z.tried = 1;
    static const char *const names[] = {"libzstd.so.1", "libzstd.so", "libzstd.1.dylib", "libzstd.dylib"};
    void *lib = NULL;
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]) && !lib; i++) lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    if (!lib) return 0;
    void *(*create)(void) = (void *(*)(void))dlsym(lib, "ZSTD_createCCtx");
    Z.bound = (size_t(*)(size_t))dlsym(lib, "ZSTD_compressBound");
    Z.is_error = (unsigned (*)(size_t))dlsym(lib, "ZSTD_isError");
    Z.compress = (CompressCCtx)dlsym(lib, "ZSTD_compressCCtx");
    if (!create || !Z.bound || !Z.is_error || !Z.compress || !(Z.cctx = create())) Z.compress = NULL;
    return Z.compress != NULL;
}

/* --- bytes ---------------------------------------------------------------------------------------- */

static int buf_varint(Buf *b, uint64_t v) {
    if (buf_reserve(b, 10) < 0) return -1;
    while (v >= 0x80) {
        b->data[b->len++] = (char)((v & 0x7F) | 0x80);
        v >>= 7;
    }
    b->data[b->len++] = (char)v;
    return 0;
}

static int buf_u32(Buf *b, uint32_t v) {
    unsigned char le[4] = {(unsigned char)v, (unsigned char)(v >> 8), (unsigned char)(v >> 16), (unsigned char)(v >> 24)};
    return buf_put(b, (const char *)le, 4);
}

/* --- Thrift's compact protocol (parquet.thrift's structs) -------------------------------------------- */

enum { C_TRUE = 1, C_I32 = 5, C_I64 = 6, C_BINARY = 8, C_LIST = 9, C_STRUCT = 12 };

typedef struct {
    Buf *b;
    int last[8];       /* the last field id written at each struct depth */
    int depth;
    PyObject *parts;   /* list: where offsets are left open (tc_offset), the bytes between them */
    PyObject *values;  /* list: the offsets, relative to the first column chunk */
} Tc;

static int tc_field(Tc *t, int id, int type) {
    int delta = id - t->last[t->depth];
    t->last[t->depth] = id;
    if (delta > 0 && delta <= 15) return buf_char(t->b, (char)(delta << 4 | type));
    return buf_char(t->b, (char)type) < 0 ? -1 : buf_varint(t->b, (uint64_t)((id << 1) ^ (id >> 31)));
}

static int tc_zigzag(Tc *t, long long v) { return buf_varint(t->b, ((uint64_t)v << 1) ^ (uint64_t)(v >> 63)); }

static int tc_i32(Tc *t, int id, long long v) { return tc_field(t, id, C_I32) < 0 ? -1 : tc_zigzag(t, v); }
static int tc_i64(Tc *t, int id, long long v) { return tc_field(t, id, C_I64) < 0 ? -1 : tc_zigzag(t, v); }

/* a file offset: the bytes so far become a part, the offset a value (parquet_pages.RowGroupTemplate) */
static int tc_offset(Tc *t, int id, long long v) {
    if (tc_field(t, id, C_I64) < 0) return -1;
    PyObject *part = PyBytes_FromStringAndSize(t->b->data, t->b->len);
    PyObject *value = part ? PyLong_FromLongLong(v) : NULL;
    int rc = value && PyList_Append(t->parts, part) == 0 && PyList_Append(t->values, value) == 0 ? 0 : -1;
    Py_XDECREF(part);
    Py_XDECREF(value);
    t->b->len = 0;
    return rc;
}

static int tc_binary(Tc *t, const char *s, Py_ssize_t n) {
    return buf_varint(t->b, (uint64_t)n) < 0 ? -1 : buf_put(t->b, s, n);
}

static int tc_list(Tc *t, int id, Py_ssize_t n, int type) {
    if (id && tc_field(t, id, C_LIST) < 0) return -1;
    if (n < 15) return buf_char(t->b, (char)(n << 4 | type));
    return buf_char(t->b, (char)(0xF0 | type)) < 0 ? -1 : buf_varint(t->b, (uint64_t)n);
}

/* a struct (a field ``id``, or a list's item with id 0) */
static int tc_begin(Tc *t, int id) {
    if (id && tc_field(t, id, C_STRUCT) < 0) return -1;
    t->last[++t->depth] = 0;
    return 0;
}

static int tc_end(Tc *t) {
    t->depth--;
    return buf_char(t->b, 0);
}

/* --- levels: the RLE / bit-packed hybrid, fed runs ------------------------------------------------- */

typedef struct {
    Buf out;
    int width;      /* bits per value */
    int value;      /* the pending run */
    Py_ssize_t count;
    Buf lit;        /* values not yet written, a byte each: a bit-packed run takes groups of 8 */
} Rle;

static int rle_literals(Rle *r) {
    Py_ssize_t n = r->lit.len;
    if (!n) return 0;
    while (n % 8) {  /* (only at the end: padding the decoder ignores) */
        if (buf_char(&r->lit, 0) < 0) return -1;
        n++;
    }
    if (buf_varint(&r->out, (uint64_t)(n / 8) << 1 | 1) < 0 || buf_reserve(&r->out, n * r->width / 8 + 1) < 0) return -1;
    uint64_t acc = 0;
    int bits = 0;
    const unsigned char *v = (const unsigned char *)r->lit.data;
    for (Py_ssize_t i = 0; i < n; i++) {
        acc |= (uint64_t)v[i] << bits;
        bits += r->width;
        while (bits >= 8) {
            r->out.data[r->out.len++] = (char)(acc & 0xFF);
            acc >>= 8;
            bits -= 8;
        }
    }
    r->lit.len = 0;
    return 0;
}

static int rle_flush_run(Rle *r) {
    Py_ssize_t n = r->count;
    r->count = 0;
    if (n >= 8) {  /* a repeated run: the literals before it first, completed to a group of 8 */
        Py_ssize_t fill = (8 - r->lit.len % 8) % 8;
        if (fill) {
            if (buf_reserve(&r->lit, fill) < 0) return -1;
            memset(r->lit.data + r->lit.len, r->value, (size_t)fill);
            r->lit.len += fill;
            n -= fill;
        }
        if (rle_literals(r) < 0) return -1;
        if (!n) return 0;
        if (buf_varint(&r->out, (uint64_t)n << 1) < 0) return -1;
        return buf_char(&r->out, (char)r->value);  /* (levels take at most 8 bits: one byte) */
    }
    if (buf_reserve(&r->lit, n) < 0) return -1;
    memset(r->lit.data + r->lit.len, r->value, (size_t)n);
    r->lit.len += n;
    return 0;
}

static int rle_put(Rle *r, int value, Py_ssize_t n) {
    if (r->count && value == r->value) {
        r->count += n;
        return 0;
    }
    if (r->count && rle_flush_run(r) < 0) return -1;
    r->value = value;
    r->count = n;
    return 0;
}

static int rle_finish(Rle *r) { return (r->count && rle_flush_run(r) < 0) || rle_literals(r) < 0 ? -1 : 0; }

/* --- the columns ------------------------------------------------------------------------------------ */

enum { P_BOOLEAN = 0, P_INT32 = 1, P_INT64 = 2, P_FLOAT = 4, P_DOUBLE = 5, P_BYTES = 6 };
enum { K_NONE, K_SCHEMA, K_VERSION, K_RULE };  /* the constant columns */

typedef struct {
    const char *path;   /* path_in_schema, dotted */
    int type;
    int lists[3];       /* the list columns above it, from the top */
    int n_lists;
    int col;            /* its values' column (or a constant) */
    int constant;
} Leaf;

#define L0 {0, 0, 0}, 0
#define TURNS(...) {R_TURNS, __VA_ARGS__}
#define SAMPLES(...) {R_SAMPLES, __VA_ARGS__}
static const Leaf LEAVES[] = {
    {"schema", P_BYTES, L0, 0, K_SCHEMA},
    {"schema_version", P_INT64, L0, 0, K_VERSION},
    {"rollout_id", P_BYTES, L0, R_ROLLOUT_ID, 0},
    {"chat_id", P_BYTES, L0, R_CHAT_ID, 0},
    {"leaf_message_id", P_BYTES, L0, R_LEAF_ID, 0},
    {"user_id", P_BYTES, L0, R_USER_ID, 0},
    {"model_name", P_BYTES, L0, R_MODEL, 0},
    {"tokenizer_hash", P_BYTES, L0, R_TOKENIZER, 0},
    {"template_hash", P_BYTES, L0, R_TEMPLATE, 0},
    {"engine", P_BYTES, L0, R_ENGINE, 0},
    {"system_prompt", P_BYTES, L0, R_SYSTEM, 0},
    {"tools", P_BYTES, L0, R_TOOLS, 0},
    {"turns.list.element.message_id", P_BYTES, TURNS(0, 0), 1, U_MESSAGE_ID, 0},
    {"turns.list.element.prompt_delta_ids.list.element", P_INT32, TURNS(U_DELTA, 0), 2, U_DELTA_ITEMS, 0},
    {"turns.list.element.completion_ids.list.element", P_INT32, TURNS(U_COMPLETION, 0), 2, U_COMPLETION_ITEMS, 0},
    {"turns.list.element.logprobs.list.element", P_FLOAT, TURNS(U_LOGPROBS, 0), 2, U_LOGPROBS_ITEMS, 0},
    {"turns.list.element.finish_reason", P_BYTES, TURNS(0, 0), 1, U_FINISH, 0},
    {"turns.list.element.stop_reason", P_BYTES, TURNS(0, 0), 1, U_STOP, 0},
    {"turns.list.element.synthetic_closer_ids.list.element", P_INT32, TURNS(U_CLOSER, 0), 2, U_CLOSER_ITEMS, 0},
    {"turns.list.element.reused_prefix_len", P_INT64, TURNS(0, 0), 1, U_REUSED, 0},
    {"turns.list.element.fork", P_BOOLEAN, TURNS(0, 0), 1, U_FORK, 0},
    {"turns.list.element.prompt_method", P_BYTES, TURNS(0, 0), 1, U_METHOD, 0},
    {"turns.list.element.prompt_length", P_INT64, TURNS(0, 0), 1, U_PROMPT_LENGTH, 0},
    {"turns.list.element.sampling", P_BYTES, TURNS(0, 0), 1, U_SAMPLING, 0},
    {"turns.list.element.reward", P_DOUBLE, TURNS(0, 0), 1, U_REWARD, 0},
    {"turns.list.element.done", P_BOOLEAN, TURNS(0, 0), 1, U_DONE, 0},
    {"turns.list.element.policy_versions.list.element.list.element", P_INT64, TURNS(U_VERSIONS, U_VERSIONS_SPANS), 3,
     U_VERSIONS_ITEMS, 0},
    {"turns.list.element.content", P_BYTES, TURNS(0, 0), 1, U_CONTENT, 0},
    {"turns.list.element.reasoning_content", P_BYTES, TURNS(0, 0), 1, U_REASONING, 0},
    {"turns.list.element.tool_calls", P_BYTES, TURNS(0, 0), 1, U_TOOL_CALLS, 0},
    {"turns.list.element.created_at", P_BYTES, TURNS(0, 0), 1, U_CREATED, 0},
    {"samples.list.element.token_ids.list.element", P_INT32, SAMPLES(S_IDS, 0), 2, S_IDS_ITEMS, 0},
    {"samples.list.element.loss_mask.list.element", P_INT32, SAMPLES(S_MASK, 0), 2, S_MASK_ITEMS, 0},
    {"samples.list.element.logprobs.list.element", P_FLOAT, SAMPLES(S_LOGPROBS, 0), 2, S_LOGPROBS_ITEMS, 0},
    {"samples.list.element.prompt_length", P_INT64, SAMPLES(0, 0), 1, S_PROMPT_LENGTH, 0},
    {"samples.list.element.turn_spans.list.element.list.element", P_INT64, SAMPLES(S_SPANS, S_SPANS_PAIRS), 3,
     S_SPANS_ITEMS, 0},
    {"samples.list.element.turn_indices.list.element", P_INT64, SAMPLES(S_INDICES, 0), 2, S_INDICES_ITEMS, 0},
    {"samples.list.element.temperatures.list.element", P_DOUBLE, SAMPLES(S_TEMPERATURES, 0), 2, S_TEMPERATURES_ITEMS, 0},
    {"samples.list.element.policy_versions.list.element", P_INT32, SAMPLES(S_VERSIONS, 0), 2, S_VERSIONS_ITEMS, 0},
    {"reward", P_DOUBLE, L0, R_REWARD, 0},
    {"reward_rule", P_BYTES, L0, 0, K_RULE},
    {"complete", P_BOOLEAN, L0, R_COMPLETE, 0},
    {"policy_paths", P_BYTES, L0, R_POLICY_PATHS, 0},
};
#define N_LEAVES ((int)(sizeof(LEAVES) / sizeof(LEAVES[0])))

/* Definition levels (every field nullable, as pyarrow's schema has them): a list adds three (it is
 * there, it has an item, the item is not null), of which a list of lists shares one; a struct's field
 * one more. So a list at depth i that is there but empty has ``EMPTY[i]``; a value under ``n`` lists
 * has ``DEFINED[n]``, one less where it is null. */
static const int EMPTY[3] = {1, 4, 6};
static const int DEFINED[4] = {1, 4, 6, 8};

static int max_def(const Leaf *l) { return DEFINED[l->n_lists]; }

static int value_size(int type) { return type == P_INT32 || type == P_FLOAT ? 4 : type == P_BOOLEAN ? 1 : 8; }

/* the constants: the schema's name, its version, the reward rule */
typedef struct {
    const char *schema, *rule;
    Py_ssize_t schema_len, rule_len;
    long long version;
} Consts;

/* one column chunk being written: its current page's levels and values, and its statistics */
typedef struct {
    const Leaf *leaf;
    Col *cols;
    Col *c;              /* the values' column (NULL: a constant) */
    Py_ssize_t cur[3];   /* the next row of each list column below the top one */
    Py_ssize_t item;     /* the next row of the values' column */
    Rle rep, def;
    Py_ssize_t levels;   /* the page's */
    Buf values;
    uint64_t bits;       /* booleans not yet written (bit-packed) */
    int n_bits;
    /* the chunk's */
    Py_ssize_t nulls, total_levels, pages;
    int stats;           /* a top-level column: min and max kept */
    int has_minmax;
    const char *min_s, *max_s;
    Py_ssize_t min_n, max_n;
    long long min_i, max_i;
    double min_d, max_d;
} Chunk;

static int emit(Chunk *k, int def, int rep, Py_ssize_t n) {
    if (n <= 0) return 0;
    k->levels += n;
    if (rle_put(&k->def, def, n) < 0) return -1;
    return k->leaf->n_lists ? rle_put(&k->rep, rep, n) : 0;
}

static int put_bool(Chunk *k, int v) {
    k->bits |= (uint64_t)(v != 0) << k->n_bits;
    if (++k->n_bits == 8) {
        k->n_bits = 0;
        char byte = (char)k->bits;
        k->bits = 0;
        return buf_char(&k->values, byte);
    }
    return 0;
}

static void stat_str(Chunk *k, const char *s, Py_ssize_t n) {
    if (!k->has_minmax) {
        k->has_minmax = 1;
        k->min_s = k->max_s = s;
        k->min_n = k->max_n = n;
        return;
    }
    Py_ssize_t m = n < k->min_n ? n : k->min_n;
    int c = memcmp(s, k->min_s, (size_t)m);
    if (c < 0 || (c == 0 && n < k->min_n)) k->min_s = s, k->min_n = n;
    m = n < k->max_n ? n : k->max_n;
    c = memcmp(s, k->max_s, (size_t)m);
    if (c > 0 || (c == 0 && n > k->max_n)) k->max_s = s, k->max_n = n;
}

static void stat_value(Chunk *k, const char *at) {
    int type = k->leaf->type;
    if (type == P_DOUBLE) {
        double d;
        memcpy(&d, at, 8);
        if (isnan(d)) return;  /* (NaN orders nothing: left out, as pyarrow does) */
        if (!k->has_minmax) k->min_d = k->max_d = d;
        if (d < k->min_d) k->min_d = d;
        if (d > k->max_d) k->max_d = d;
        k->has_minmax = 1;
        return;
    }
    long long v = 0;
    if (type == P_INT64) memcpy(&v, at, 8);
    else if (type == P_BOOLEAN) v = *at != 0;
    else return;
    if (!k->has_minmax || v < k->min_i) k->min_i = v;
    if (!k->has_minmax || v > k->max_i) k->max_i = v;
    k->has_minmax = 1;
}

/* the plain values of rows [first, first + n) of the values' column, all valid */
static int put_values(Chunk *k, Py_ssize_t first, Py_ssize_t n) {
    Col *c = k->c;
    int type = k->leaf->type;
    if (type == P_BYTES) {
        const int32_t *off = (const int32_t *)c->offsets.data;
        for (Py_ssize_t j = first; j < first + n; j++) {
            Py_ssize_t len = off[j + 1] - off[j];
            if (buf_u32(&k->values, (uint32_t)len) < 0 || buf_put(&k->values, c->values.data + off[j], len) < 0) return -1;
            if (k->stats) stat_str(k, c->values.data + off[j], len);
        }
        return 0;
    }
    if (type == P_BOOLEAN) {
        for (Py_ssize_t j = first; j < first + n; j++) {
            if (put_bool(k, c->values.data[j]) < 0) return -1;
            if (k->stats) stat_value(k, c->values.data + j);
        }
        return 0;
    }
    Py_ssize_t size = value_size(type);
    if (k->stats)
        for (Py_ssize_t j = first; j < first + n; j++) stat_value(k, c->values.data + size * j);
    return buf_put(&k->values, c->values.data + size * first, size * n);
}

/* rows [first, first + n) of the values' column: the first with repetition level ``rep``, the rest ``next`` */
static int put_items(Chunk *k, Py_ssize_t first, Py_ssize_t n, int rep, int next) {
    int def = max_def(k->leaf);
    Col *c = k->c;
    if (!c->nulls) {
        if (emit(k, def, rep, 1) < 0 || emit(k, def, next, n - 1) < 0) return -1;
        return put_values(k, first, n);
    }
    for (Py_ssize_t j = 0; j < n; j++) {
        int valid = c->valid.data[first + j] != 0;
        if (emit(k, valid ? def : def - 1, j ? next : rep, 1) < 0) return -1;
        if (valid ? put_values(k, first + j, 1) < 0 : 0) return -1;
        k->nulls += !valid;
    }
    return 0;
}

/* row ``row`` of the list column at depth ``i``, its first item with repetition level ``rep`` */
static int put_list(Chunk *k, int i, Py_ssize_t row, int rep) {
    const Leaf *l = k->leaf;
    Py_ssize_t n = ((const int32_t *)k->cols[l->lists[i]].values.data)[row];
    if (!n) return emit(k, EMPTY[i], rep, 1);
    if (i + 1 == l->n_lists) {
        Py_ssize_t first = k->item;
        k->item += n;
        return put_items(k, first, n, rep, i + 1);
    }
    Py_ssize_t first = k->cur[i + 1];
    k->cur[i + 1] += n;
    for (Py_ssize_t j = 0; j < n; j++)
        if (put_list(k, i + 1, first + j, j ? i + 1 : rep) < 0) return -1;
    return 0;
}

static int put_constant(Chunk *k, const Consts *v) {
    if (emit(k, 1, 0, 1) < 0) return -1;
    if (k->leaf->constant == K_VERSION) {
        if (buf_put(&k->values, (const char *)&v->version, 8) < 0) return -1;
        k->has_minmax = 1;
        k->min_i = k->max_i = v->version;
        return 0;
    }
    const char *s = k->leaf->constant == K_SCHEMA ? v->schema : v->rule;
    Py_ssize_t n = k->leaf->constant == K_SCHEMA ? v->schema_len : v->rule_len;
    if (buf_u32(&k->values, (uint32_t)n) < 0 || buf_put(&k->values, s, n) < 0) return -1;
    stat_str(k, s, n);
    return 0;
}

static int put_row(Chunk *k, Py_ssize_t row, const Consts *v) {
    if (!k->c) return put_constant(k, v);
    if (!k->leaf->n_lists) return put_items(k, row, 1, 0, 0);
    return put_list(k, 0, row, 0);
}

/* --- pages and chunks ------------------------------------------------------------------------------ */

#define MAX_STAT 4096         /* statistics of longer strings are left out, as pyarrow's max_statistics_size */

typedef struct {
    Buf file, footer;  /* the column chunks; the row group's metadata since its last offset (Thrift) */
    Buf body, packed;  /* a page before and after compression */
    int level;
    Py_ssize_t page_bytes;  /* a data page ends after the row that takes its values past this */
    Py_ssize_t rows;
    long long uncompressed, compressed;  /* the row group's */
} Out;

static int bit_width(int v) {
    int w = 0;
    while (v >> w) w++;
    return w;
}

static int levels_into(Buf *body, Rle *r) {
    if (rle_finish(r) < 0 || buf_u32(body, (uint32_t)r->out.len) < 0 || buf_put(body, r->out.data, r->out.len) < 0)
        return -1;
    r->out.len = 0;
    return 0;
}

/* the chunk's current page, compressed, into the file */
static int flush_page(Out *o, Chunk *k, long long *uncompressed, long long *compressed) {
    if (!k->levels) return 0;
    if (k->n_bits) {
        char byte = (char)k->bits;
        k->bits = 0;
        k->n_bits = 0;
        if (buf_char(&k->values, byte) < 0) return -1;
    }
    o->body.len = 0;
    if (k->leaf->n_lists && levels_into(&o->body, &k->rep) < 0) return -1;
    if (levels_into(&o->body, &k->def) < 0 || buf_put(&o->body, k->values.data, k->values.len) < 0) return -1;
    size_t cap = Z.bound((size_t)o->body.len);
    o->packed.len = 0;
    if (buf_reserve(&o->packed, (Py_ssize_t)cap) < 0) return -1;
    size_t n = Z.compress(Z.cctx, o->packed.data, cap, o->body.data, (size_t)o->body.len, o->level);
    if (Z.is_error(n)) {
        PyErr_SetString(PyExc_RuntimeError, "zstd could not compress a Parquet page");
        return -1;
    }
    Py_ssize_t at = o->file.len;
    Tc t = {&o->file, {0}, 0, NULL, NULL};
    if (tc_i32(&t, 1, 0) < 0 || tc_i32(&t, 2, o->body.len) < 0 || tc_i32(&t, 3, (long long)n) < 0 ||
        tc_begin(&t, 5) < 0 || tc_i32(&t, 1, k->levels) < 0 || tc_i32(&t, 2, 0) < 0 || tc_i32(&t, 3, 3) < 0 ||
        tc_i32(&t, 4, 3) < 0 || tc_end(&t) < 0 || buf_char(&o->file, 0) < 0)
        return -1;
    Py_ssize_t header = o->file.len - at;
    if (buf_put(&o->file, o->packed.data, (Py_ssize_t)n) < 0) return -1;
    *uncompressed += header + o->body.len;
    *compressed += header + (long long)n;
    k->total_levels += k->levels;
    k->levels = 0;
    k->values.len = 0;
    k->pages++;
    return 0;
}

static int put_stat_value(Tc *t, int id, Chunk *k, int max) {
    int type = k->leaf->type;
    if (type == P_BYTES) return tc_field(t, id, C_BINARY) < 0 ? -1 : tc_binary(t, max ? k->max_s : k->min_s, max ? k->max_n : k->min_n);
    char raw[8];
    Py_ssize_t n = 8;
    if (type == P_DOUBLE) {
        double d = max ? k->max_d : k->min_d;
        if (d == 0) d = max ? 0.0 : -0.0;  /* (the format's rule for zeros) */
        memcpy(raw, &d, 8);
    } else if (type == P_BOOLEAN) {
        raw[0] = (char)(max ? k->max_i : k->min_i);
        n = 1;
    } else {
        long long v = max ? k->max_i : k->min_i;
        memcpy(raw, &v, 8);
    }
    return tc_field(t, id, C_BINARY) < 0 ? -1 : tc_binary(t, raw, n);
}

/* the ColumnChunk of a chunk written from ``start`` */
static int chunk_meta(Tc *t, Chunk *k, Py_ssize_t start, long long uncompressed, long long compressed) {
    const Leaf *l = k->leaf;
    if (tc_begin(t, 0) < 0 || tc_i64(t, 2, 0) < 0 || tc_begin(t, 3) < 0 || tc_i32(t, 1, l->type) < 0 ||
        tc_list(t, 2, 2, C_I32) < 0 || tc_zigzag(t, 0) < 0 || tc_zigzag(t, 3) < 0)
        return -1;
    Py_ssize_t parts = 1;
    for (const char *s = l->path; *s; s++) parts += *s == '.';
    if (tc_list(t, 3, parts, C_BINARY) < 0) return -1;
    for (const char *s = l->path;;) {
        const char *dot = strchr(s, '.');
        Py_ssize_t n = dot ? dot - s : (Py_ssize_t)strlen(s);
        if (tc_binary(t, s, n) < 0) return -1;
        if (!dot) break;
        s = dot + 1;
    }
    if (tc_i32(t, 4, 6) < 0 || tc_i64(t, 5, k->total_levels) < 0 || tc_i64(t, 6, uncompressed) < 0 ||
        tc_i64(t, 7, compressed) < 0 || tc_offset(t, 9, start) < 0)
        return -1;
    if (k->stats) {
        int minmax = k->has_minmax && (l->type != P_BYTES || (k->min_n <= MAX_STAT && k->max_n <= MAX_STAT));
        if (tc_begin(t, 12) < 0 || tc_i64(t, 3, k->nulls) < 0) return -1;
        if (minmax && (put_stat_value(t, 5, k, 1) < 0 || put_stat_value(t, 6, k, 0) < 0)) return -1;
        if (tc_end(t) < 0) return -1;
    }
    /* encoding_stats: the data pages, all PLAIN */
    if (tc_list(t, 13, 1, C_STRUCT) < 0 || tc_begin(t, 0) < 0 || tc_i32(t, 1, 0) < 0 || tc_i32(t, 2, 0) < 0 ||
        tc_i32(t, 3, k->pages) < 0 || tc_end(t) < 0)
        return -1;
    return tc_end(t) < 0 || tc_end(t) < 0 ? -1 : 0;
}

static void chunk_free(Chunk *k) {
    PyMem_Free(k->rep.out.data);
    PyMem_Free(k->rep.lit.data);
    PyMem_Free(k->def.out.data);
    PyMem_Free(k->def.lit.data);
    PyMem_Free(k->values.data);
}

static int write_chunk(Out *o, Tc *t, Col *cols, const Leaf *l, const Consts *v) {
    Chunk k;
    memset(&k, 0, sizeof(k));
    k.leaf = l;
    k.cols = cols;
    k.c = l->constant ? NULL : &cols[l->col];
    k.stats = !l->n_lists;
    k.rep.width = bit_width(l->n_lists);
    k.def.width = bit_width(max_def(l));
    Py_ssize_t start = o->file.len;
    long long uncompressed = 0, compressed = 0;
    int rc = 0;
    for (Py_ssize_t row = 0; row < o->rows && rc == 0; row++) {
        rc = put_row(&k, row, v);
        if (rc == 0 && k.values.len >= o->page_bytes) rc = flush_page(o, &k, &uncompressed, &compressed);
    }
    if (rc == 0) rc = flush_page(o, &k, &uncompressed, &compressed);
    if (rc == 0) rc = chunk_meta(t, &k, start, uncompressed, compressed);
    o->uncompressed += uncompressed;
    o->compressed += compressed;
    chunk_free(&k);
    return rc;
}

/* The page as a Parquet row group (parquet_pages.PageFile's parts): (its column chunks' bytes, the
 * Thrift RowGroup's bytes between its offsets, the offsets relative to the first chunk, rows); None: the
 * Python path (a page this code does not take, or no libzstd). ``extra``: (schema name, schema version,
 * reward rule, zstd level, data page size), the constant columns, the compression and the pages' size
 * (pyarrow's data_page_size: 1 MiB). */
PyObject *page_parquet(Page *p, PyObject *extra) {
    Consts v;
    int level;
    Py_ssize_t page_bytes;
    if (!PyArg_ParseTuple(extra, "s#Ls#in", &v.schema, &v.schema_len, &v.version, &v.rule, &v.rule_len, &level,
                          &page_bytes))
        return NULL;
    if (!zstd_ready()) Py_RETURN_NONE;
    Col cols[N_COLS];
    memset(cols, 0, sizeof(cols));
    Out o;
    memset(&o, 0, sizeof(o));
    o.level = level;
    o.page_bytes = page_bytes;
    o.rows = p->n_rollouts;
    PyObject *result = NULL;
    Tc t = {&o.footer, {0}, 0, PyList_New(0), PyList_New(0)};
    int rc = page_cols(p, cols);
    if (rc == -3) {
        Py_INCREF(Py_None);
        result = Py_None;
        goto done;
    }
    if (rc < 0 || !t.parts || !t.values) goto done;
    /* RowGroup: columns (1), total_byte_size (2), num_rows (3), file_offset (5), total_compressed_size (6) */
    if (tc_begin(&t, 0) < 0 || tc_list(&t, 1, N_LEAVES, C_STRUCT) < 0) goto done;
    for (int i = 0; i < N_LEAVES; i++)
        if (write_chunk(&o, &t, cols, &LEAVES[i], &v) < 0) goto done;
    if (tc_i64(&t, 2, o.uncompressed) < 0 || tc_i64(&t, 3, o.rows) < 0 || tc_offset(&t, 5, 0) < 0 ||
        tc_i64(&t, 6, o.compressed) < 0 || tc_end(&t) < 0)
        goto done;
    PyObject *last = PyBytes_FromStringAndSize(o.footer.data, o.footer.len);
    if (!last || PyList_Append(t.parts, last) < 0) {
        Py_XDECREF(last);
        goto done;
    }
    Py_DECREF(last);
    result = Py_BuildValue("(y#NNn)", o.file.data ? o.file.data : "", o.file.len, PyList_AsTuple(t.parts),
                           PyList_AsTuple(t.values), o.rows);
done:
    Py_XDECREF(t.parts);
    Py_XDECREF(t.values);
    cols_free(cols);
    PyMem_Free(o.file.data);
    PyMem_Free(o.footer.data);
    PyMem_Free(o.body.data);
    PyMem_Free(o.packed.data);
    return result;
}

/* the leaf columns as this code writes them: [(path, physical type, max definition, max repetition)] */
PyObject *parquet_leaves(PyObject *self, PyObject *unused) {
    PyObject *out = PyList_New(N_LEAVES);
    for (int i = 0; out && i < N_LEAVES; i++) {
        const Leaf *l = &LEAVES[i];
        PyObject *item = Py_BuildValue("(siii)", l->path, l->type, max_def(l), l->n_lists);
        if (!item) Py_CLEAR(out);
        else PyList_SET_ITEM(out, i, item);
    }
    return out;
}
