"""The workloads room: what is done with models, end to end.

* `einpage.workloads.generation`: generation plans (unrolled, or step plans per length
  bucket) and the loop that runs them;
* `einpage.workloads.generate`: `generate(...)`, tokens out of a model in one call;
* `einpage.workloads.text`: tokenizers for text in and out of generation;
* `einpage.workloads.chat`: chat templates (a checkpoint's Jinja2 template, sandboxed);
* `einpage.workloads.stop`: stopping sequences at end-of-sequence ids or stop strings;
* `einpage.workloads.training`: training steps (forward, loss, backward, optimizer).

It builds on the program, pipeline and models rooms; only the command line and the
package's facade import it (`tests/test_imports.py`).
"""
