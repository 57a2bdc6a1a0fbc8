"""Layer 8, tools (never imported by the runtime layers): benchmarks (:mod:`.bench`), the simulator
(:mod:`.sim`), the emulated cluster (:mod:`.cluster`), the ops report (:mod:`.ops_report`) and real-token
data (:mod:`.data`). One CLI: ``python -m zen_ds <tool> ...`` (``zen-ds``)."""
