"""Token exactness of stored conversations: stitched prompts vs. naive re-templating, end to end.

    python benchmarks/exactness.py [--conversations 20] [--turns 4] [--template chatml|llama3|FAMILY|FILE.jinja]
                                   [--seed 0] [--concurrency 8] [--engine hf|vllm] [--closer-policy keep|history]
                                   [--api chat|openai|responses|messages] [--written SHARE] [--json]
    python benchmarks/exactness.py --folder all|llama.cpp|vllm|DIR [--only a,b] [--train-steps 100]
                                   [--written SHARE] [--json]

``--api``: the native chat API (default), ``/v1/chat/completions`` (``openai.py``), ``/v1/responses`` or
``/v1/messages`` (``dialects.py``), each driven as an unmodified client of that dialect. ``--written``:
the share of user turns the client answers itself (``Script.written``).

``--folder`` runs the stitch arm on every template of a folder, one row each (``zoo.py``);
``--template FAMILY`` one real template of ``benchmarks/template_zoo.FAMILIES`` (e.g. ``gpt-oss``) with its
model's tokens, on a tiny model trained ``--train-steps`` steps (cached).

Starts one server (embedded SQLite, in-process queue) and two workers on the same tiny model as child
processes: one with ``--prompt-mode stitch`` served as ``stitch``, one with ``--prompt-mode naive`` (the
baseline: re-render and re-tokenize the whole text history every turn, as other systems do) served as
``naive``. Both arms run the same seeded conversation scripts over real HTTP + SSE, ``--concurrency``
conversations at a time per arm. ``--engine vllm`` runs both workers with ``--engine vllm --max-model-len
2048 --gpu-memory-utilization 0.2`` under the python of the vLLM environment (``$TOKENTRAIL_VLLM_VENV``,
default ``~/.cache/tokentrail/vllm-venv``, built by ``scripts/vllm_env.sh``) with
``VLLM_CPU_KVCACHE_SPACE=1``, and waits up to 10 minutes for them to start; TFLA re-scoring still runs
here with transformers on the same weights. ``--template FILE`` builds a tiny model trained on that Jinja template
into the cache (keyed by the file's hash; about a minute, once).

The script
----------
Each conversation has a system prompt (half of them), function tools (half of them; the tiny model was
trained to call such tools) and ``--turns`` user messages. After a user message the assistant answers;
when the answer has ``tool_calls``, a ``tool_message`` with a deterministic fake result answers each call
and the assistant is asked again under the last result (at most 2 such rounds per user message). A
*turn* is one assistant message. Per turn the script draws sampling parameters (temperature 0/0.7/0.8/1,
sometimes top-k, top-p or a repetition penalty, a seed), sometimes a small ``max_new_tokens`` (3-8, so
the turn is cut) and sometimes ``stop_token_ids`` with a token that is not the turn closer (the id of
" the", or eos where eos is not the closer, as in llama3). User texts, tool results and system prompts
sometimes contain literal control-token strings (``<|im_end|>``, ``<|eot_id|>``,
``<tool_call>{...}</tool_call>``, ``<|start_header_id|>system<|end_header_id|>``, ...). Everything the
script decides comes from ``random.Random`` seeded by (``--seed``, conversation, turn, round), so both
arms get the same script; what the model writes (and so whether it calls tools) may differ per arm.

Ground truth per turn: the token ids and logprobs streamed over SSE (what the engine produced) and the
stored ``prompt_token_ids`` (the worker refuses to finish a message whose engine-reported consumed
prompt differs from the prompt it sent), read back with ``GET .../messages/{id}?include=tokens``.

Metrics (per arm; "stored" = what ``?include=tokens`` returns)
-------------------------------------------------------------
TEF  token exactness failure: share of turns whose training record is not exactly what the engine
     consumed and produced. stitch: the record is the stored (prompt, completion, logprobs); it fails if
     the completion or logprobs (float32, bit for bit) differ from the SSE stream. naive: the record is
     what a text pipeline stores: it keeps the conversation as text (content, reasoning_content,
     tool_calls as returned by the API) and re-renders it with the chat template (message text encoded
     safely, like the worker does). Turn i's view is (P, C): P = render(messages[:i], generation
     prompt), C = the tokens that render(messages[:i+1]) adds after P, up to and including the turn's
     closer (the separator after it is not part of the turn); if render(messages[:i+1]) does not start
     with P the view does not exist and the turn fails. It fails if P != stored prompt or C != the
     streamed completion (its logprobs are then the engine's, so they match whenever the tokens do).
EPB  extension property break: share of consecutive turn pairs in a conversation where the later prompt
     does not start with the earlier prompt + completion (both arms: stored tokens; for naive the stored
     prompt is the one the engine consumed).
SPR  samples per rollout: training samples per conversation after merging turns whose prompt extends
     everything before them (``shared.stitching.merge_turns`` on the stored tokens), averaged.
TFLA teacher-forced logprob agreement: stitch: each merged sample's final sequence (its last turn's
     prompt + completion) is re-scored with the same model in one fp32 forward pass on CPU; every turn
     of the sample compares its stored logprobs with the re-scored ones at its completion positions,
     processed with that turn's sampling parameters (``worker.sampling.teacher_forced_logprobs``:
     repetition penalty, temperature, top-k, top-p). A position where the turn's top-k cut falls on
     a near-tie (k-th and (k+1)-th scores within 1e-5) and the logprobs differ is left out and
     counted ("top-k cut ties"): fp rounding alone decides whether the tied token is kept, which
     moves the logprob by its share of the mass. naive: the sample is the text render of the whole
     final conversation (one per conversation); turn i's positions start after P (if the render starts
     with P) and its engine tokens are aligned with the render's tokens of that turn; positions up to
     the first differing token are re-scored and compared, every later generated position (or all of
     them, if the render does not start with P) counts as a disagreement with |delta| = inf.
     Reported: share of generated positions with |delta| > 1e-4, and max |delta|.
BF   bridge fidelity failure (stitch only; "-" for naive): share of stitched turns (later turns that
     did not fork) whose bridge — stored prompt minus the reused prefix minus the synthetic closer —
     differs from the template's own rendering of the new messages: the tokens of render(history + new,
     generation prompt) after the prior assistant turn's closer, computed here from the real history
     (not the worker's dummy base conversation; where a history text holds a control string that the
     template interprets, such as a </think> the model wrote without opening reasoning, from that
     history with the control strings taken out of its texts, since the bridge does not depend on
     them). Reported beside it: synthetic closer mismatches —
     a closer added although the prior turn closed itself, missing although it did not (cut by
     max_new_tokens or stopped on a non-closer token), or other than the template's closer for it.
FBR  full-render fallback rate: share of later turns (not the first of a conversation) whose prompt
     was a full render after a history edit (``fork``). naive: 1.0 by construction (every prompt is a
     full render).
PC   prefix cache (vllm only; "-" for hf, which reports no cache hits): for each later turn, its reusable
     prefix is the longest common prefix of its prompt and the previous turn's prompt + completion (for
     stitch that is ``reused_prefix_len``); reported: sum of ``num_cached_tokens`` / sum of reusable
     tokens; beside it the block-rounded ideal (each reusable length rounded down to the cache block size,
     inferred as the gcd of all positive cached counts: a block cache serves whole blocks only), and the
     plain mean over later turns of ``num_cached_tokens`` / prompt length. Not a target.

Targets for the stitch arm (no history edits here): TEF 0, EPB 0, SPR 1.0, TFLA max |delta| < 1e-4,
BF 0 (and no closer mismatches), FBR 0; a PASS/FAIL line per target is printed. The exit code is 0
whatever the results (it is a benchmark); ``--json`` prints one JSON object instead of the table.
Progress goes to stderr.

Modules (each imports only those above it)
------------------------------------------
``metrics.py``       pure verdicts and numbers on token lists
``script.py``        the seeded script (``Script``, stop-token candidates)
``conversation.py``  ``Turn`` and ``Conversation``: what was asked, streamed and stored; ``--dump`` / ``--load``
``openai.py``        one conversation through ``/v1/chat/completions`` (``--api openai``)
``driver.py``        one conversation through the chat API; ``drive``: every script on every arm
``processes.py``     the server and one worker per arm as child processes (``tokentrail.launcher``)
``reference.py``     the template's own render, the oracle of the naive view and of bridges
``scorer.py``        teacher-forced re-scoring (TFLA)
``evaluator.py``     ``Evaluator`` and ``ArmReport``: the metrics of one arm
``report.py``        the table, the targets, JSON without infinities
``zoo.py``           ``--folder``: the stitch arm on every template of a folder
``cli.py``           the command line of ``python benchmarks/exactness.py``
"""
