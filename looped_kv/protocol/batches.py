"""Pre-registered batches: spec, frozen file table, run, archive, verification and the prediction ledger.

The RIPE paper's evidence comes from nine pre-registered batches (Section 5, "Protocol";
Appendix A, Table 5): decision rules and predictions frozen before each run, a frozen file table
(SHA-256), self-tests on the node, and an archive verified at both ends, with every failed
prediction reported (Appendix B, Table 6). This module is that workflow:

1. A batch is a YAML spec (see ``looped_kv/batch_specs/*.yaml``): question, model, prompt sets, arms,
   metrics, decision rules and predictions. :func:`load_spec` validates all of it before any work
   (:mod:`looped_kv.protocol.spec`).
2. :func:`freeze` checks the spec against its model (texts at least ``tokens`` long, sequences and sinks
   within its ``block_size``, a tokenizer) and writes a file table: the SHA-256 of the spec, its prompt
   files, the package's own source files and the local model files. :func:`run_batch` refuses to run
   when any of them has changed since (:mod:`looped_kv.protocol.freeze`).
3. :func:`run_batch` checks the table, creates ``<out>.partial`` with its marker, runs the self-tests
   (:mod:`looped_kv.protocol.selftest`), runs every arm with progress bars in the spec's CPU thread count
   (sharded across processes under ``torchrun``, :mod:`looped_kv.protocol.distributed`), and writes
   per-position and per-prompt records as JSON lines, a summary, the decision rules' labels and the
   predictions' outcomes (:mod:`looped_kv.protocol.decide`), and a checksum manifest (``MANIFEST.sha256``,
   the format of ``sha256sum -c``), optionally signed with a key; it renames the folder to ``out`` when
   complete and never deletes a folder it did not mark (:mod:`looped_kv.protocol.run`,
   :mod:`looped_kv.protocol.archive`).
4. :func:`verify` re-checks an archive: every checksum and no file outside it, the frozen table against
   the archived spec, the self-tests in ``run.json``, records that cover exactly the frozen prompts and
   arms with the fields their arms write, and the summary and labels recomputed from them. An unkeyed
   manifest shows that nothing changed by accident, not who wrote the archive: a consistently rewritten
   measurement verifies unless the manifest is signed (:mod:`looped_kv.protocol.verify` says what is
   proved). :func:`compare` says whether two archives of one frozen spec agree byte for byte, and by how
   much each metric differs where they do not. :func:`ledger` prints the predictions of several archives
   (each once) in the layout of Appendix B (batch, prediction, outcome: held or failed).

Two measurement modes exist. ``substitution``: teacher-forced replay of texts whose arms substitute
a reference plane into a region of loops (RIPE Sec. 3.1, batches 2 and 9). ``generation``: a greedy
reference trajectory per prompt, replayed token by token through each arm's cache policy and
precision (Sec. 5.1, batches 3, 7 and 8), and real decoders (Sec. 5.2).

Spec keys (unknown keys are errors)::

    batch, name, question             id shown in the ledger, short name, the question asked
    model, revision                   'tiny', a folder (relative to the spec) or a hub id with its revision
    dtype, num_loops, seed            weights dtype, R, bootstrap seed; cudnn_sdp: false (default) disables
                                      cuDNN attention (RIPE Sec. 5.5)
    threads                           torch CPU threads of every process (default 1): frozen with the spec, so
                                      that alone or under torchrun a run writes the same bytes
    mode                              substitution | generation
    prompts                           [{name, file}]: JSON lists of texts (or {"texts": [...]}) beside the spec
    substitution: tokens, decoded, softmax    texts cut to `tokens`; the last `decoded` are decoded positions
    generation: max_new_tokens, reference, tail_kl   reference = {cache, window, k, sinks, precision}
    arms       substitution: {name, region: shallow|deep|"lo-hi"|[loops], plane, kv: k|v|kv}
               generation: {name, decoder: replay|ar|self-spec|mature-spec|pld|das-wave, cache, window, k,
                            sinks, precision, and the decoder's options (draft_loops, gamma, prefix_reads, ...)}
    metrics                           prompt-level metrics summarised per arm (METRICS)
    decision_rules   {name, statistic, threshold, labels: {above, between, below}, n_boot, level, and
                      ratio: metric, numerator, denominator | mean: metric, arm |
                      fidelity: arm, precision_arm, bins | region_coefficient: arms, floor (KL at or below
                      the measurement floor is raised to it and kept in the fit, as RIPE Sec. 3.1 keeps floor rows)}
    predictions      {text, rule, label: a label of the rule (or a list)} or {text, rule, range: [low, high]}

A rule's outcome is "above" when its bootstrap interval lies above the threshold, "below" when it lies
below, and "between" otherwise; it is "undefined" when the data leave the statistic undefined (e.g. a
ratio whose denominator arm has no tail position). A prediction holds when the rule's label is one it
names, or its estimate lies in its range.
"""

from looped_kv.protocol.archive import (
    MANIFEST,
    SIGNATURE,
    order_records,
    read_jsonl,
    read_key,
    write_jsonl,
    write_manifest,
)
from looped_kv.protocol.compare import Comparison, compare
from looped_kv.protocol.decide import decide, outcome, summarize
from looped_kv.protocol.freeze import check_runnable, check_table, freeze, read_table, sha256, table_changes
from looped_kv.protocol.run import Interrupted, run_arms, run_batch
from looped_kv.protocol.spec import EXAMPLES_DIR, BatchSpec, example_names, load_spec, resolve_spec, units
from looped_kv.protocol.verify import ledger, ledger_rows, verify

__all__ = ["EXAMPLES_DIR", "MANIFEST", "SIGNATURE", "BatchSpec", "Comparison", "Interrupted", "check_runnable",
           "check_table", "compare", "decide", "example_names", "freeze", "ledger", "ledger_rows", "load_spec",
           "order_records", "outcome", "read_jsonl", "read_key", "read_table", "resolve_spec", "run_arms", "run_batch",
           "sha256", "summarize", "table_changes", "units", "verify", "write_jsonl", "write_manifest"]
