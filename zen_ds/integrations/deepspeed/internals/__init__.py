"""The plug-in's boundary with DeepSpeed: the only code in ``zen_ds`` that reads DeepSpeed's
private attributes, imports its non-public modules or replaces methods on its objects
(``tests/unit/test_plugin_layout.py`` checks the whole package for it).

DeepSpeed 0.19 has no reduction hook, no engine factory and no config plug-in registry, so zen
wraps a few methods *on one engine instance* (never on DeepSpeed's classes; other engines in the
process are untouched) and reads a few private attributes. One module per DeepSpeed component,
each listing in its docstring what it reads or wraps; all were checked against DeepSpeed 0.19.8
(:func:`.initialize.check_deepspeed_version` refuses releases outside 0.19.x):

* :mod:`.initialize`: ``deepspeed.initialize`` (``zen_ds.enable()``'s patch) and the version gate;
* :mod:`.engine`: ``DeepSpeedEngine`` (the reduction, the model step, fp32 clipping, the
  data-parallel group and scaling knobs);
* :mod:`.pipeline`: ``PipelineEngine`` (the tied-weight reduction);
* :mod:`.zero12`: the ZeRO-1/2 optimizer (``DeepSpeedZeroOptimizer``);
* :mod:`.bf16` / :mod:`.fp16`: the half-precision optimizer wrappers;
* :mod:`.zero3`: the ZeRO-3 optimizer and ``zero.Init``;
* :mod:`.checkpoint`: the engine's checkpoint and 16-bit export methods, ``zero_to_fp32``;
* :mod:`.tensor_fragment`: ``deepspeed.utils``' whole-param accessors (``safe_get_full_fp32_param``, ...);
* :mod:`.comm`: ``deepspeed.comm``'s timer, handed to :mod:`zen_ds.core.comm`.

Porting zen to another DeepSpeed release means re-checking these modules only. Their functions
take zen's side as callbacks or small protocols: nothing here decides anything about zen.
"""
