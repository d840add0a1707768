/* A page of native rollouts built from its rows (page_build.c), and what the caller passes: shared by
 * the writers (page_jsonl.c) and the module (module.c). See server/export/fastpage.py. */
#ifndef TOKENTRAIL_PAGE_H
#define TOKENTRAIL_PAGE_H
#include "json_buf.h"

/* the row layouts of server/export/query.py (M_* and T_*): checked against it at import */
enum { M_ID, M_PARENT, M_ROLE, M_STATE, M_CONTENT, M_REASONING, M_TOOL_CALLS, M_MODEL, M_WORK, M_SCORE,
       M_VOTED, M_CREATED, M_CHAT, M_POLICY, M_REWARD, M_DONE, M_COUNT };
enum { T_ID, T_PROMPT, T_COMPLETION, T_LOGPROBS, T_FINISH, T_STOP, T_ENGINE, T_TOKENIZER, T_TEMPLATE,
       T_REUSED, T_SYNTH, T_FORK, T_METHOD, T_COUNT };

enum { RULE_LAST, RULE_MEAN, RULE_MIN, RULE_LEAF };

/* dict keys (interned at import) and builtins.sum */
extern PyObject *K_SAMPLING, *K_SEED, *K_TEMPERATURE, *K_SYSTEM_PROMPT, *K_TOOLS, *SUM;

/* --- what the caller passes -------------------------------------------------------------------------- */

typedef struct {
    int rated_only, include_incomplete, rule;
    int has_min_score;
    double min_score;
    PyObject *leaf_passes;    /* callable(leaf row) -> bool, or None: no model or date filter */
    PyObject *recent_enough;  /* callable(used versions, model) -> bool, or None: no version filter */
    PyObject *path;           /* callable(model, version) -> str | None */
    PyObject *json;           /* Decoders.json */
    PyObject *loads;          /* orjson.loads where json is _json_loads (its checks made in C), else None */
    PyObject *created;        /* callable(raw created_at) -> str | None (not SQLite's text), or None: raw.isoformat() */
    PyObject *stop_reason;    /* decode_stop_reason */
    PyObject *dumps;          /* callable(value) -> bytes: orjson.dumps */
    PyObject *floats;         /* callable(float32 bytes) -> bytes: their JSON array, widened to float64 */
    PyObject *head;           /* b'{"schema":...,"schema_version":...' */
    PyObject *rule_text;      /* the reward rule's JSON text */
    PyObject *stop_cache;     /* dict: raw stop reason -> its JSON text */
    PyObject *decoded;        /* the page's JSON columns decoded: raw text -> value (read, never changed) */
    PyObject *sampling_parts; /* raw sampling parameters -> (record's JSON before the seed, after it, temperature) */
} Opts;

/* --- a page's turns and rollouts ------------------------------------------------------------------- */

typedef struct {
    long long start, version;
} Span;

typedef struct {
    PyObject *msg, *tok;               /* borrowed: the rows live in the page's chats */
    PyObject *prompt, *completion, *logprobs;  /* owned bytes */
    Py_ssize_t n_prompt, n_completion, prev_len;
    int extends;
    Span *spans;
    Py_ssize_t n_spans;
    PyObject *work;                    /* owned: dict, or NULL where its members were read from its text */
    PyObject *reward;                  /* owned: float, or NULL */
    PyObject *temperature;             /* owned: float */
    PyObject *sampling;                /* owned: the record's sampling, as JSON */
    Py_ssize_t lp_first;               /* its first logprob among the page's */
    int lp_null;                       /* a logprob is not finite (JSON null) */
    Py_ssize_t rec_start, rec_end;     /* its record in the turns buffer */
    Py_ssize_t delta_at, delta_end, comp_at, comp_end;  /* its id items in the turns buffer */
} Turn;

typedef struct {
    long long v;        /* a version the rollout's turns use */
    PyObject *path;     /* owned: its checkpoint directory (str), or None */
} PathEntry;

typedef struct {
    PyObject *chat_id, *user_id, *leaf;  /* borrowed */
    Py_ssize_t *turns;
    Py_ssize_t n_turns;
    PyObject *reward;                    /* owned float or NULL */
    int complete;
    PathEntry *paths;
    Py_ssize_t n_paths;
    PyObject *leaf_work;                 /* owned dict */
} Rollout;

typedef struct {
    Opts *o;
    Turn *turns;
    Py_ssize_t n_turns, cap_turns;
    Rollout *rollouts;
    Py_ssize_t n_rollouts, cap_rollouts;
    PyObject *index;     /* message id -> turn number (int), or None: the version filters leave it out */
} Page;

/* page_build.c */
PyObject *field(PyObject *row, Py_ssize_t i);
PyObject *get(PyObject *dict, PyObject *key);
PyObject *decode(Opts *o, PyObject *raw);
int add_chat(Page *p, PyObject *chat);

/* json_members.c: 1 with the spans of the named members' values (start -1: absent), 0 not taken */
int json_members(const char *s, Py_ssize_t n, const char *const *names, int k, Py_ssize_t *start, Py_ssize_t *end);
void page_free(Page *p);
#define CREATED_MAX 40
int plain_created(Opts *o, PyObject *raw, char iso[CREATED_MAX]);
PyObject *created_text(Opts *o, PyObject *raw);
int created_init(void);
void turn_versions(const Turn *t, int32_t *out);

/* sqlite_rows.c */
PyObject *sqlite_open(PyObject *self, PyObject *args);
PyObject *sqlite_rows(PyObject *self, PyObject *args);
PyObject *sqlite_close(PyObject *self, PyObject *capsule);

/* pg_rows.c */
PyObject *pg_open(PyObject *self, PyObject *arg);
PyObject *pg_rows(PyObject *self, PyObject *args);
int pg_init(void);

/* page_jsonl.c */
int buf_value(Buf *b, Opts *o, PyObject *v);
int buf_stop(Buf *b, Opts *o, PyObject *raw);
int buf_policy_paths(Buf *b, Opts *o, Rollout *r);
PyObject *page_jsonl(Page *p);

/* page_arrow.c */
PyObject *page_arrow(Page *p);

/* page_parquet.c */
PyObject *page_parquet(Page *p, PyObject *extra);
PyObject *parquet_leaves(PyObject *self, PyObject *unused);

#endif
