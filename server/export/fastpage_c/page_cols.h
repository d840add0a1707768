/* A built page's columns (page_arrow.c builds them): Arrow-like buffers that page_arrow.c hands to
 * Python and page_parquet.c writes as Parquet column chunks.
 *
 * Each column is up to three buffers: values (int32/int64/float32/float64 little-endian, one byte per
 * bool, or the UTF-8 of strings), string offsets (int32, from 0), validity (one byte per row, 0 for
 * null; absent while nothing is null). A list column is its rows' lengths (int32) and its items are
 * the next column (``*_ITEMS``, or for a list of lists the next two). Item columns of token ids hold
 * values only (never null); a logprob item of a turn has a validity entry each. */
#ifndef TOKENTRAIL_PAGE_COLS_H
#define TOKENTRAIL_PAGE_COLS_H
#include "page.h"

typedef struct {
    Buf values, offsets, valid;
    Py_ssize_t rows, nulls;
} Col;

enum {
    /* rollouts */
    R_ROLLOUT_ID, R_CHAT_ID, R_LEAF_ID, R_USER_ID, R_MODEL, R_TOKENIZER, R_TEMPLATE, R_ENGINE, R_SYSTEM,
    R_TOOLS, R_REWARD, R_COMPLETE, R_POLICY_PATHS, R_TURNS, R_SAMPLES,
    /* turns */
    U_MESSAGE_ID, U_DELTA, U_DELTA_ITEMS, U_COMPLETION, U_COMPLETION_ITEMS, U_LOGPROBS, U_LOGPROBS_ITEMS,
    U_FINISH, U_STOP, U_CLOSER, U_CLOSER_ITEMS, U_REUSED, U_FORK, U_METHOD, U_PROMPT_LENGTH, U_SAMPLING,
    U_REWARD, U_DONE, U_VERSIONS, U_VERSIONS_SPANS, U_VERSIONS_ITEMS, U_CONTENT, U_REASONING, U_TOOL_CALLS,
    U_CREATED,
    /* samples */
    S_IDS, S_IDS_ITEMS, S_MASK, S_MASK_ITEMS, S_LOGPROBS, S_LOGPROBS_ITEMS, S_PROMPT_LENGTH, S_SPANS,
    S_SPANS_PAIRS, S_SPANS_ITEMS, S_INDICES, S_INDICES_ITEMS, S_TEMPERATURES, S_TEMPERATURES_ITEMS,
    S_VERSIONS, S_VERSIONS_ITEMS,
    N_COLS
};

extern const char *const COL_NAMES[N_COLS];

/* the page's rollouts into ``cols`` (zeroed by the caller): 0, -1 error, -3 a value of another type
 * (the Python path); the caller frees them (cols_free) whatever the result */
int page_cols(Page *p, Col cols[N_COLS]);
void cols_free(Col cols[N_COLS]);

#endif
