"""ZeRO stage 3 with zen, against stock ZeRO-3 on 2 gloo ranks (one spawn, many cases).

zen replaces only the reduce-scatter of its params' gradients (non-zero rows on the wire) and
gives DeepSpeed the same partitions, so parameters after training equal stock's (2e-4 relative in
fp32, bf16 rounding in bf16), with accumulation and clipping; models built inside
``deepspeed.zero.Init`` (a Hugging Face Llama-style untied model) and outside it; a GPT-2-style
tied embedding is left to DeepSpeed; checkpoints resume bit for bit; ``save_16bit_model`` and
``zero_to_fp32`` give the trained embedding; an id outside the table raises the same error on
every rank and the group stays usable; the embedding's bytes are a few % of the dense
reduce-scatter's; two backwards before ``step()`` (with ``engine.zero_grad()`` or the optimizer's
between them) apply what stock ZeRO-3 applies, with and without row-sharded tables.
"""
from __future__ import annotations

import functools
import os
import tempfile
from typing import Any, Dict

import numpy as np
import pytest

from dist_utils import run_ranks, skip_unless_installed

pytest.importorskip("deepspeed")
skip_unless_installed("transformers")

import ds_cases as dc  # noqa: E402

# The suite runs 2 ranks and a tiny vocabulary; BENCHMARKS' acceptance run sets 4 and 32000.
WORLD = int(os.environ.get("ZEN_DS_ZERO3_WORLD", "2"))
VOCAB = int(os.environ.get("ZEN_DS_ZERO3_VOCAB", "320"))  # the Hugging Face models' vocabulary
BIG_VOCAB = 20000
# Row-sharded tables (zen steps their rows; DeepSpeed never sees them), however small
ROWS = {"row_sharded": True, "optimizer_state": "sharded", "stats_interval": 0}
# Micro-batches of step 0 whose averaged gradients the step applies: stock ZeRO-3 adds a second
# backward's reduction into its gradient partitions (its micro-step counter advances at the second
# forward). engine.zero_grad() only drops param.grad (ZeRO-3 has none left after the backward), so
# both still count; the optimizer's zero_grad() restarts the counter: the second replaces the first
SECOND_BACKWARD = {"second_backward": [0, 1], "engine_zero_grad_between": [0, 1],
                   "optimizer_zero_grad_between": [1]}


def _config(zen: bool, gas: int = 1, clip: float = 0.0, dtype: str = "fp32", adamw: bool = False,
            micro: int = dc.MICRO) -> Dict[str, Any]:
    return dc.zero3_config(WORLD, {"enabled": True, "stats_interval": 0} if zen else None, gas, clip, dtype,
                           adamw, micro)


def _gathered(engine) -> Dict[str, Any]:
    import deepspeed
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        return dc.params_of(engine.module)


def _net_run(rank: int, zen: bool, gas: int = 2, clip: float = 0.5, dtype: str = "fp32", steps: int = 3,
             inf_at: Any = None):
    """The suite's Net (two dense-grad embeddings + MLP), SGD, built outside zero.Init;
    ``inf_at=(step, rank)``: that rank's first micro-batch of that step has an inf target (an
    fp16 overflow: DeepSpeed skips the step on every rank)."""
    import deepspeed
    model = dc.make_model(False)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=dc.make_optimizer(model.parameters()),
                                           config=_config(zen, gas, clip, dtype))
    for step in range(steps):
        for micro in range(gas):
            a, b, y = dc.batch(step, micro, rank, inf_at=inf_at)
            engine.backward(dc.loss_fn(engine(a, b), y))
            engine.step()
    return engine


def _hf_model(tied: bool):
    import deepspeed
    import transformers
    import torch
    torch.manual_seed(0)
    if tied:
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=1, n_head=2)
        cls = transformers.GPT2LMHeadModel
    else:
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                                          num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                          tie_word_embeddings=False, max_position_embeddings=32)
        cls = transformers.LlamaForCausalLM
    with deepspeed.zero.Init(config_dict_or_path=_config(False, adamw=True)):
        return cls(config)


def _hf_run(rank: int, zen: bool, tied: bool, steps: int = 3):
    import deepspeed
    import torch
    model = _hf_model(tied)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=_config(zen, adamw=True, micro=2))
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        ids = (torch.rand(2, 12, generator=g).pow(3) * VOCAB).long()  # skewed: low ids frequent
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    return engine


def _worker(rank: int, world: int, save_dir: str) -> Dict[str, Any]:
    import warnings
    import torch
    import torch.distributed as dist
    import zen_ds
    warnings.filterwarnings("ignore")
    dc.set_env(rank, world)
    zen_ds.enable()  # before zero.Init: the Hugging Face models are built inside it
    out: Dict[str, Any] = {}

    def net_case(name: str, **kw: Any) -> None:
        for zen in (False, True):
            engine = _net_run(rank, zen, **kw)
            out[f"{name}_{'zen' if zen else 'stock'}"] = _gathered(engine)
            out[f"{name}_{'zen' if zen else 'stock'}_skipped"] = int(engine.skipped_steps)
            if zen:
                state = zen_ds.state_of(engine)
                out[f"{name}_route"] = (state.route.name, [p.name for p in state.reducer.params])
                out[f"{name}_rows"] = sorted(t.name for t in state.route.zero3.rows.tables.values())

    def hf_case(tied: bool) -> None:
        name = "gpt2_tied" if tied else "llama_untied"
        for zen in (False, True):
            engine = _hf_run(rank, zen, tied)
            out[f"{name}_{'zen' if zen else 'stock'}"] = _gathered(engine)
            if zen:
                state = zen_ds.state_of(engine)
                out[f"{name}_route"] = (state.route.name, [p.name for p in state.reducer.params],
                                        dict(state.route.zero3.left))
                out[f"{name}_rows"] = sorted(t.name for t in state.route.zero3.rows.tables.values())

    def checkpoints() -> None:
        import deepspeed
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        path = os.path.join(save_dir, "ckpt")
        engine = _net_run(rank, True, gas=1, clip=0.0, steps=2)
        engine.save_checkpoint(path, tag="t")
        engine.save_16bit_model(path, "model16.bin")
        for step in (2, 3):
            a, b, y = dc.batch(step, 0, rank)
            engine.backward(dc.loss_fn(engine(a, b), y))
            engine.step()
        uninterrupted = _gathered(engine)
        model = dc.make_model(False)
        fresh, _, _, _ = deepspeed.initialize(model=model, optimizer=dc.make_optimizer(model.parameters()),
                                              config=_config(True, 1, 0.0))
        fresh.load_checkpoint(path, tag="t")
        at_save = _gathered(fresh)
        for step in (2, 3):
            a, b, y = dc.batch(step, 0, rank)
            fresh.backward(dc.loss_fn(fresh(a, b), y))
            fresh.step()
        out["resumed"] = (uninterrupted, _gathered(fresh))
        dist.barrier()
        sixteen = torch.load(os.path.join(path, "model16.bin"), map_location="cpu", weights_only=False)
        fp32 = get_fp32_state_dict_from_zero_checkpoint(path, tag="t")
        out["consolidated"] = (at_save, {k: v.detach().float().numpy() for k, v in sixteen.items()},
                               {k: v.detach().float().numpy() for k, v in fp32.items()})

    def trainer_save() -> None:
        # The Trainer under ZeRO-3 (model built in zero.Init), then save_model(): the saved
        # embedding must be the trained one, zen's equal to stock's.
        from safetensors.torch import load_file
        example = dc.load_hf_trainer_example()
        for zen in (False, True):
            tag = "zen" if zen else "stock"
            target = os.path.join(save_dir, f"trainer_{tag}")
            argv = ["--model", "llama", "--zero", "3", "--vocab", str(VOCAB), "--hidden", "16",
                    "--layers", "1", "--seq-len", "12", "--batch", "2", "--grad-accum", "2",
                    "--steps", "2", "--clip", "0.5", "--save-model", target] + ([] if zen else ["--no-zen"])
            trainer, summary = example.train(example.parse_args(argv))
            trained = _gathered(trainer.model_wrapped)
            dist.barrier()
            saved = load_file(os.path.join(target, "model.safetensors"))
            out[f"trainer_{tag}"] = (summary["zen"], trained["model.embed_tokens.weight"],
                                     saved["model.embed_tokens.weight"].float().numpy())
            out[f"trainer_{tag}_params"] = trained

    def bad_id() -> None:
        engine = _net_run(rank, True, gas=1, clip=0.0, steps=1)
        a, b, y = dc.batch(5, 0, rank)
        if rank == 1:
            b = b.clone()
            b[0, 0] = dc.VOCAB_D  # one past the table
        try:
            engine(a, b)
            out["bad_id"] = ("no error", "")
        except Exception as exc:
            out["bad_id"] = (type(exc).__name__, str(exc))
        flag = torch.ones(1)
        dist.all_reduce(flag)  # the group is still usable
        out["after_bad_id"] = float(flag)

    def bytes_case() -> None:
        import deepspeed
        torch.manual_seed(3)
        model = torch.nn.Sequential(torch.nn.Embedding(BIG_VOCAB, 16), torch.nn.Linear(16, 1))
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=dc.make_optimizer(model.parameters()),
                                               config=_config(True))
        g = torch.Generator().manual_seed(rank)
        for _ in range(2):
            ids = (torch.rand(dc.MICRO, 64, generator=g).pow(3) * BIG_VOCAB).long()
            engine.backward(engine(ids).pow(2).mean())
            engine.step()
        st = zen_ds.state_of(engine).reducer.last_stats["0.weight"]
        dense_rs = 2 * (WORLD - 1) * st.dense_bytes // WORLD  # sent + received by a ring reduce-scatter
        out["bytes"] = (st.bytes_sent + st.bytes_received, dense_rs, st.scheme)

    def refusal() -> None:
        import deepspeed
        model = dc.make_model(False)
        cfg = _config(True)
        cfg["zen"]["scheme"] = "agsparse"  # (compression runs under ZeRO-3: test_compression_zero.py)
        try:
            deepspeed.initialize(model=model, optimizer=dc.make_optimizer(model.parameters()), config=cfg)
            out["refusal"] = ("no error", "")
        except Exception as exc:
            out["refusal"] = (type(exc).__name__, str(exc))

    def second_backward(name: str, zero_grad_between: str = "") -> None:
        """Two forward+backward passes before one step (accumulation 1; ``zero_grad_between``:
        "engine" or "optimizer", whose ``zero_grad()`` runs between them), stock and zen, with and
        without row-sharded tables."""
        import deepspeed
        for tag, block in (("stock", None), ("zen", {"stats_interval": 0}), ("rows", ROWS)):
            model = dc.make_model(False)
            engine, optimizer, *_ = deepspeed.initialize(model=model, optimizer=dc.make_optimizer(model.parameters()),
                                                         config=dc.zero3_config(WORLD, block))
            for micro in (0, 1):
                if micro and zero_grad_between:
                    (engine if zero_grad_between == "engine" else optimizer).zero_grad()
                a, b, y = dc.batch(0, micro, rank)
                engine.backward(dc.loss_fn(engine(a, b), y))
            engine.step()
            out[f"{name}_{tag}"] = dc.whole_weights(engine)
            state = zen_ds.state_of(engine)
            out[f"{name}_{tag}_tables"] = [t.name for t in state.route.tables] if state else []

    def fp16_case() -> None:
        dc.accept_fp16_on_cpu()  # DeepSpeed's CPU accelerator allows fp16 only with oneDNN's kernels
        net_case("net_fp16", dtype="fp16", inf_at=(1, 1))

    jobs = {"net_fp32": lambda: net_case("net_fp32"),
            "net_bf16": lambda: net_case("net_bf16", dtype="bf16"),
            "net_fp16": fp16_case, "trainer_save": trainer_save,
            "llama": lambda: hf_case(False), "gpt2": lambda: hf_case(True),
            "checkpoints": checkpoints, "bad_id": bad_id, "bytes": bytes_case, "refusal": refusal,
            **{name: functools.partial(second_backward, name, between)
               for name, between in (("second_backward", ""), ("engine_zero_grad_between", "engine"),
                                     ("optimizer_zero_grad_between", "optimizer"))}}
    errors = dc.run_jobs({k: v for k, v in jobs.items()})
    out.update({f"job_{k}": v for k, v in errors.items() if isinstance(v, dict) and "error" in v})
    return out


@pytest.fixture(scope="module")
def results():
    with tempfile.TemporaryDirectory() as save_dir:
        return run_ranks(WORLD, _worker, save_dir, fresh=True)


def _no_job_failed(results, job: str) -> None:
    for rank, res in enumerate(results):
        failure = res.get(f"job_{job}")
        assert failure is None, f"rank {rank}: {failure.get('traceback', failure)}"


def _close(got: Dict[str, Any], want: Dict[str, Any], rtol: float) -> None:
    errors = dc.max_rel_err(got, want)
    assert max(errors.values()) <= rtol, errors


@pytest.mark.parametrize("case, rtol", [("net_fp32", 2e-4), ("net_bf16", 2e-2), ("net_fp16", 2e-3)])
def test_zero3_matches_stock(results, case: str, rtol: float) -> None:
    _no_job_failed(results, case)
    for res in results:
        _close(res[f"{case}_zen"], res[f"{case}_stock"], rtol)
        assert res[f"{case}_route"] == ("zero3", ["emb_s.weight", "emb_d.weight"])
        assert res[f"{case}_rows"] == ["emb_d.weight", "emb_s.weight"]  # both at batch cost (the default)
        assert res[f"{case}_zen_skipped"] == res[f"{case}_stock_skipped"]


@pytest.mark.parametrize("case", sorted(SECOND_BACKWARD))
@pytest.mark.parametrize("engine", ["zen", "rows"])
def test_second_backward_before_step_as_stock_zero3(results, case: str, engine: str) -> None:
    """Two backwards before step(), as test_ds_behaviour.py checks at ZeRO-0/1/2: stock ZeRO-3
    applies the sum of both averaged gradients (the last one after the optimizer's zero_grad), and
    so does zen, stepping the tables' partitions (their rows wait at the sender) or row-sharded."""
    _no_job_failed(results, case)
    want = dc.summed_reference(False, SECOND_BACKWARD[case], WORLD, WORLD)
    for res in results:
        _close(res[f"{case}_stock"], want, 1e-5)
        _close(res[f"{case}_{engine}"], res[f"{case}_stock"], 1e-5)
        tables = res[f"{case}_{engine}_tables"]
        # zen steps the tables either way: row-sharded, or their ZeRO-3 partitions (the default)
        assert tables == ["emb_s.weight", "emb_d.weight"], tables


def test_fp16_overflow_skips_the_same_steps(results) -> None:
    for res in results:  # the inf on rank 1 at step 1 skips that step on every rank, zen or not
        assert res["net_fp16_zen_skipped"] >= 1 and res["net_fp16_stock_skipped"] >= 1


def test_trainer_matches_stock_and_save_model_holds_the_trained_embedding(results) -> None:
    _no_job_failed(results, "trainer_save")
    for res in results:
        zen_attached, zen_trained, zen_saved = res["trainer_zen"]
        stock_attached, stock_trained, stock_saved = res["trainer_stock"]
        assert zen_attached and not stock_attached
        np.testing.assert_array_equal(zen_saved, zen_trained)
        np.testing.assert_array_equal(stock_saved, stock_trained)
        _close({"emb": zen_saved}, {"emb": stock_saved}, 2e-4)
        _close(res["trainer_zen_params"], res["trainer_stock_params"], 2e-4)  # every param


def test_hf_llama_built_under_zero_init(results) -> None:
    _no_job_failed(results, "llama")
    for res in results:
        _close(res["llama_untied_zen"], res["llama_untied_stock"], 2e-4)
        route, names, left = res["llama_untied_route"]
        assert route == "zero3" and names == ["model.embed_tokens.weight"] and not left
        assert res["llama_untied_rows"] == ["model.embed_tokens.weight"]  # never gathered


def test_hf_gpt2_tied_embedding_left_to_deepspeed(results) -> None:
    _no_job_failed(results, "gpt2")
    for res in results:
        _close(res["gpt2_tied_zen"], res["gpt2_tied_stock"], 2e-4)
        route, names, left = res["gpt2_tied_route"]
        assert route == "zero3" and "transformer.wte.weight" in left and "tied" in left["transformer.wte.weight"]
        assert "transformer.wte.weight" not in names
        assert res["gpt2_tied_rows"] == ["transformer.wpe.weight"]  # the untied position table


def test_resume_is_bit_identical(results) -> None:
    _no_job_failed(results, "checkpoints")
    for res in results:
        uninterrupted, resumed = res["resumed"]
        for k in uninterrupted:
            np.testing.assert_array_equal(resumed[k], uninterrupted[k], err_msg=k)


def test_16bit_model_and_zero_to_fp32_hold_the_trained_embedding(results) -> None:
    at_save, sixteen, fp32 = results[0]["consolidated"]
    for name in ("emb_s.weight", "emb_d.weight"):
        np.testing.assert_array_equal(sixteen[name], at_save[name])
        np.testing.assert_array_equal(fp32[name], at_save[name])


def test_bad_id_raises_on_every_rank(results) -> None:
    _no_job_failed(results, "bad_id")
    for res in results:
        kind, message = res["bad_id"]
        assert kind == "ZenInputError", res["bad_id"]
        assert "rank 1" in message and f"outside the table [0, {dc.VOCAB_D})" in message, message
        assert res["after_bad_id"] == WORLD


def test_embedding_bytes_are_a_few_percent_of_the_dense_reduce_scatter(results) -> None:
    for res in results:
        wire, dense_rs, scheme = res["bytes"]
        assert scheme == "reduce_scatter_flat"
        assert wire <= 0.05 * dense_rs, (wire, dense_rs)


def test_a_scheme_without_reduce_scatter_is_refused_naming_the_key(results) -> None:
    for res in results:
        kind, message = res["refusal"]
        assert kind == "ZenConfigError" and '"zen.scheme": "agsparse"' in message, res["refusal"]
