"""Pre-registered batches: spec, frozen file table, run, archive, verification and the prediction ledger.

The RIPE paper's evidence comes from nine pre-registered batches (Section 5, "Protocol";
Appendix A, Table 5): decision rules and predictions frozen before each run, a frozen file table
(SHA-256), self-tests on the node, and an archive verified at both ends, with every failed
prediction reported (Appendix B, Table 6). This module is that workflow:

1. A batch is a YAML spec (see ``looped_kv/batch_specs/*.yaml``): question, model, prompt sets, arms,
   metrics, decision rules and predictions. :func:`load_spec` validates all of it before any work.
2. :func:`freeze` writes a file table: the SHA-256 of the spec, its prompt files, the package's
   own source files and the local model files. :func:`run_batch` refuses to run when any of them
   has changed since.
3. :func:`run_batch` checks the table, runs the self-tests (:mod:`looped_kv.protocol.selftest`), runs every
   arm with progress bars in the spec's CPU thread count (sharded across processes under ``torchrun``,
   :mod:`looped_kv.protocol.distributed`), writes per-position and per-prompt records as JSON lines, a summary,
   the decision rules' labels and the predictions' outcomes, and a checksum manifest
   (``MANIFEST.sha256``, the format of ``sha256sum -c``).
4. :func:`verify` re-checks an archive: every checksum, the frozen table against the archived spec,
   and the summary and labels recomputed from the records. :func:`compare` says whether two archives
   of one frozen spec agree byte for byte, and by how much each metric differs where they do not.
   :func:`ledger` prints the predictions of several archives in the layout of Appendix B (batch,
   prediction, outcome: held or failed).

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
                            sinks, precision, and the decoder's options (draft_loops, block, prefix_reads, ...)}
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
                                        RUN_FILES,
                                        analyse,
                                        archive_files,
                                        order_records,
                                        read_jsonl,
                                        write_archive,
                                        write_json,
                                        write_jsonl,
                                        write_manifest,
)
from looped_kv.protocol.compare import Comparison, Difference, compare
from looped_kv.protocol.decide import decide, outcome, prompt_table, summarize
from looped_kv.protocol.freeze import (
                                        TABLE_FORMAT,
                                        check_table,
                                        file_table,
                                        freeze,
                                        model_folder,
                                        package_files,
                                        read_table,
                                        sha256,
                                        table_changes,
)
from looped_kv.protocol.run import run_arms, run_batch
from looped_kv.protocol.spec import (
                                        ARM_METRICS,
                                        DECODERS,
                                        EXAMPLES_DIR,
                                        METRICS,
                                        MODES,
                                        REFERENCE,
                                        Arm,
                                        BatchSpec,
                                        Prediction,
                                        PromptSet,
                                        Rule,
                                        Unit,
                                        example_names,
                                        load_spec,
                                        resolve_spec,
                                        units,
)
from looped_kv.protocol.verify import ledger, ledger_rows, verify

__all__ = ["ARM_METRICS", "DECODERS", "EXAMPLES_DIR", "MANIFEST", "METRICS", "MODES", "REFERENCE", "RUN_FILES",
           "TABLE_FORMAT", "Arm", "BatchSpec", "Comparison", "Difference", "Prediction", "PromptSet", "Rule", "Unit",
           "analyse", "archive_files", "check_table", "compare", "decide", "example_names", "file_table", "freeze",
           "ledger", "ledger_rows", "load_spec", "model_folder", "order_records", "outcome", "package_files",
           "prompt_table", "read_jsonl", "read_table", "resolve_spec", "run_arms", "run_batch", "sha256",
           "summarize", "table_changes", "units", "verify", "write_archive", "write_json", "write_jsonl",
           "write_manifest"]
