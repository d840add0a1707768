"""The pure metric functions of the exactness benchmark (``benchmarks/exactness/metrics.py``), on small
hand-made token lists."""

from __future__ import annotations

import math

from benchmarks.exactness.metrics import (
    Agreement,
    PrefixCache,
    agreement,
    aligned_prefix,
    bridge_mismatch,
    cache_block_size,
    closer_mismatch,
    expected_stitch_suffix,
    extension_breaks,
    logprob_deltas,
    naive_training_view,
    prefix_cache,
    same_logprobs,
    samples_per_rollout,
    share,
    tokens_exact,
    turn_closed,
    turn_end,
)

CLOSE = 9  # the turn closer
START = 8  # another special token (a turn opener)
CLOSERS = frozenset({CLOSE})
SPECIALS = frozenset({START, CLOSE})


def test_extension_holds_for_stitched_turns() -> None:
    t1 = ([START, 1, 2], [3, 4, CLOSE])
    t2 = ([START, 1, 2, 3, 4, CLOSE, 10, START, 5], [6, CLOSE])
    t3 = ([*t2[0], *t2[1], 10, START, 7], [8])
    assert extension_breaks([t1, t2, t3]) == [False, False]
    assert samples_per_rollout([t1, t2, t3]) == 1


def test_extension_break_is_detected() -> None:
    t1 = ([START, 1, 2], [3, 4, CLOSE])
    # re-tokenized history: the model's [3, 4] became [34]
    t2 = ([START, 1, 2, 34, CLOSE, 10, START, 5], [6, CLOSE])
    t3 = ([*t2[0], *t2[1], 10, START, 7], [8])
    assert extension_breaks([t1, t2, t3]) == [True, False]
    assert samples_per_rollout([t1, t2, t3]) == 2
    assert extension_breaks([t1]) == []


def test_merge_counts_every_break() -> None:
    t1 = ([1], [2])
    t2 = ([1, 3], [4])  # does not extend [1, 2]
    t3 = ([5], [6])  # does not extend [1, 3, 4]
    assert samples_per_rollout([t1, t2, t3]) == 3
    assert samples_per_rollout([]) == 0


def test_tokens_exact_compares_ids_and_float32_logprobs() -> None:
    prompt, completion = [1, 2], [3, CLOSE]
    assert tokens_exact(prompt, completion, [-0.5, None], prompt, completion, [-0.5, -math.inf])
    assert not tokens_exact(prompt, completion, [-0.5, -0.25], prompt, [3, 4], [-0.5, -0.25])
    assert not tokens_exact(prompt, completion, [-0.5, -0.25], [1], completion, [-0.5, -0.25])
    assert not tokens_exact(prompt, completion, [-0.5, -0.25], prompt, completion, [-0.5, -0.2500001])
    # float64 noise below float32 precision is the same stored value
    assert same_logprobs([-0.1], [-0.1 + 1e-12])
    assert not same_logprobs([float("nan")], [float("nan")])
    assert not same_logprobs([-1.0], [-1.0, -2.0])


def test_naive_view_matches_when_render_reproduces_the_tokens() -> None:
    history = [START, 1, CLOSE, 10, START, 2]
    through = [*history, 3, 4, CLOSE, 10]  # the trailing separator 10 is not part of the turn
    view = naive_training_view(history, through, CLOSERS)
    assert view == (history, [3, 4, CLOSE])
    assert view == (history, [3, 4, CLOSE])  # engine prompt and completion


def test_naive_view_detects_retokenization_and_missing_history() -> None:
    history = [START, 1, CLOSE, 10, START, 2]
    engine_completion = [3, 4, CLOSE]
    retokenized = naive_training_view(history, [*history, 34, CLOSE, 10], CLOSERS)
    assert retokenized is not None and retokenized[1] != engine_completion
    # a turn cut by max_new_tokens has no closer, but the render writes one
    cut = naive_training_view(history, [*history, 3, 4, CLOSE, 10], CLOSERS)
    assert cut is not None and cut[1] != [3, 4]
    # the render drops earlier reasoning: it no longer starts with the prompt the engine saw
    assert naive_training_view(history, [START, CLOSE, 10, START, 2, 3, 4, CLOSE], CLOSERS) is None


def test_turn_end() -> None:
    assert turn_end([1, CLOSE, 2, CLOSE], 0, CLOSERS) == 2
    assert turn_end([1, CLOSE, 2, CLOSE], 2, CLOSERS) == 4
    assert turn_end([1, 2], 0, CLOSERS) == 2


def test_turn_closed() -> None:
    assert turn_closed([1, CLOSE], "stop", CLOSE, CLOSERS)
    assert turn_closed([1, CLOSE], "length", None, CLOSERS)  # the last allowed token was the closer
    assert not turn_closed([1, 2], "length", None, CLOSERS)
    assert not turn_closed([1, 7], "stop", 7, CLOSERS)  # a stop token that is not a closer
    assert not turn_closed([], "length", None, CLOSERS)


def _stitched_case() -> tuple[list[int], list[int], list[int], list[int]]:
    """(history render, full render, prior prompt + completion, expected bridge)."""
    history = [START, 1, CLOSE, 10, START, 2, 3, CLOSE, 10]  # user, assistant (+ separator)
    bridge = [10, START, 4, CLOSE, 10, START]  # separator, new user turn, generation prompt
    full = [START, 1, CLOSE, 10, START, 2, 3, CLOSE, *bridge]
    reused = [START, 1, CLOSE, 10, START, 2, 3]  # the assistant turn was cut before its closer
    return history, full, reused, bridge


def test_expected_stitch_suffix_cuts_after_the_prior_closer() -> None:
    history, full, _, bridge = _stitched_case()
    assert expected_stitch_suffix(full, history, CLOSERS, SPECIALS) == ([CLOSE], bridge)
    assert expected_stitch_suffix(full, [1, 2], CLOSERS, SPECIALS) is None


def test_expected_stitch_suffix_when_history_leaves_the_turn_open() -> None:
    """A template that renders a final assistant message without its closer (left open for
    continuation): the closer is found from the turn's prompt, not by counting closers in history."""
    _, full, reused, bridge = _stitched_case()
    prompt = reused[:5]  # user turn + generation prompt
    open_history = reused  # the assistant turn, not closed
    # counting closers in history finds the user turn's closer: the wrong cut
    assert expected_stitch_suffix(full, open_history, CLOSERS, SPECIALS) != ([CLOSE], bridge)
    assert expected_stitch_suffix(full, open_history, CLOSERS, SPECIALS, prompt) == ([CLOSE], bridge)
    assert expected_stitch_suffix(full, [1, 2], CLOSERS, SPECIALS, [7]) is None  # no extension, nothing to count
    # a generation prompt with text that history does not render (Apriel's "Here are my reasoning
    # steps:"): the prompt does not extend into full; the end of the turn's text anchors the search
    apriel_prompt = [*prompt, 77]
    assert expected_stitch_suffix(full, open_history, CLOSERS, SPECIALS, apriel_prompt, anchor=7) == ([CLOSE], bridge)
    # an empty turn: its opener (a special token) is part of the prompt, not of the closer
    prompt = [START, 1, CLOSE, 10, START]
    empty = [*prompt, CLOSE, *bridge]
    assert expected_stitch_suffix(empty, prompt, CLOSERS, SPECIALS, prompt) == ([CLOSE], bridge)


def test_bridge_and_closer_fidelity() -> None:
    history, full, reused, bridge = _stitched_case()
    closer, expected = expected_stitch_suffix(full, history, CLOSERS, SPECIALS) or ([], [])
    good = [*reused, CLOSE, *bridge]
    assert not bridge_mismatch(good, len(reused), 1, expected)
    assert not closer_mismatch(good, len(reused), 1, closer, prior_closed=False)
    # the builder forgot the separator
    assert bridge_mismatch([*reused, CLOSE, *bridge[1:]], len(reused), 1, expected)
    # the prior turn was cut but no closer was added
    assert closer_mismatch([*reused, *bridge], len(reused), 0, closer, prior_closed=False)
    assert not bridge_mismatch([*reused, *bridge], len(reused), 0, expected)
    # a closer was added although the model closed the turn itself
    assert closer_mismatch([*reused, CLOSE, CLOSE, *bridge], len(reused) + 1, 1, closer, prior_closed=True)


def test_logprob_deltas_and_agreement() -> None:
    deltas = logprob_deltas([-1.0, None, -0.5, None], [-1.0, float("-inf"), -0.4, -3.0])
    assert deltas[:2] == [0.0, 0.0]
    assert math.isclose(deltas[2], 0.1, rel_tol=1e-6)
    assert deltas[3] == math.inf
    summary = agreement(deltas)
    assert summary == Agreement(positions=4, disagreements=2, max_delta=math.inf)
    assert agreement([1e-6, 2e-5]) == Agreement(2, 0, 2e-5)
    assert (agreement([1e-6]) + agreement([0.5])) == Agreement(2, 1, 0.5)
    assert Agreement().share is None


def test_aligned_prefix_and_share() -> None:
    assert aligned_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert aligned_prefix([], [1]) == 0
    assert share(1, 4) == 0.25
    assert share(0, 0) is None


def test_cache_block_size_is_the_gcd_of_positive_counts() -> None:
    assert cache_block_size([512, 0, None, 256, 768]) == 256
    assert cache_block_size([16, 48, 32]) == 16
    assert cache_block_size([0, None]) is None
    assert cache_block_size([]) is None


def test_prefix_cache_counts_later_turns_against_the_previous_prompt_and_completion() -> None:
    # turn 2 extends turn 1 (prompt + completion) fully; turn 3 re-tokenised: shares 3 tokens only
    turns = [
        ([1, 2, 3, 4], [5, 6], None),  # the first turn's count is not used
        ([1, 2, 3, 4, 5, 6, 7, 8], [9], 4),
        ([1, 2, 3, 0, 5, 6, 7, 8, 9, 10], [11], 2),
    ]
    report = prefix_cache([turns], block=4)
    assert report == PrefixCache(turns=2, reusable=6 + 3, cached=4 + 2, ideal=4 + 0, prompt_share_sum=4 / 8 + 2 / 10)
    assert report.served == 6 / 9
    assert report.ideal_served == 4 / 9
    assert report.mean_prompt_share == (0.5 + 0.2) / 2
    unrounded = prefix_cache([turns], block=None)
    assert unrounded is not None and unrounded.ideal == 9


def test_prefix_cache_is_none_without_counts_and_empty_without_later_turns() -> None:
    assert prefix_cache([[([1, 2], [3], None), ([1, 2, 3, 4], [5], None)]], block=16) is None
    empty = prefix_cache([[([1, 2], [3], 0)]], block=16)
    assert empty == PrefixCache()
    assert empty.served is None and empty.ideal_served is None and empty.mean_prompt_share is None


def test_top_k_cut_ties_are_left_out_of_tfla_not_hidden() -> None:
    from benchmarks.exactness.metrics import top_k_cut_tied

    scores = [9.0, 8.0, 7.4365735, 7.4365730, 7.0]
    assert top_k_cut_tied(scores, 3)  # the 3rd and 4th tie within 1e-5
    assert not top_k_cut_tied(scores, 2) and not top_k_cut_tied(scores, None) and not top_k_cut_tied(scores, 5)
    # a tied position that disagrees is counted as a tie; a tied one that agrees stays a position;
    # an untied disagreement stays a disagreement
    summary = agreement([0.0157, 1e-6, 0.3], tied=[True, True, False])
    assert summary == Agreement(positions=2, disagreements=1, max_delta=0.3, cut_ties=1)


def test_client_written_turns_are_scripted_and_mark_the_pairs_around_them() -> None:
    from benchmarks.exactness.conversation import Conversation, Turn
    from benchmarks.exactness.script import Script
    from shared.protocol import WorkMessage

    never = [Script.make(0, i, 6, ()) for i in range(20)]
    assert all(s.written(t) is None for s in never for t in range(6))  # the default script has none
    scripts = [Script.make(0, i, 6, (), written_share=0.5) for i in range(20)]
    written = [(s, t, s.written(t)) for s in scripts for t in range(6)]
    assert all(w is None for s, t, w in written if t == 0)  # never the first turn: nothing before it
    kinds = {("tool" if w["tool_calls"] else "text") for _, _, w in written if w is not None}
    assert kinds == {"tool", "text"}
    for s, t, w in written:
        assert w == s.written(t)  # seeded: both arms get the same script
        if w is not None and w["tool_calls"]:
            assert s.tools and w["tool_calls"][0]["function"]["name"] in {x["function"]["name"] for x in s.tools}
            assert w["result"]

    conv = Conversation("stitch", scripts[0])
    roles = ["user", "assistant", "user", "assistant", "user", "assistant"]  # the middle one: the client's
    conv.messages = [WorkMessage(id=f"m{i}", role=r, content="x") for i, r in enumerate(roles)]
    conv.turns = [
        Turn(at=1, new_from=0, turn=0, round=0, sampling={}),
        Turn(at=5, new_from=2, turn=2, round=0, sampling={}),
    ]
    conv.turns[0].message_id, conv.turns[1].message_id = "m1", "m5"
    assert conv.written_at() == [3]
    assert conv.after_written() == [True]
