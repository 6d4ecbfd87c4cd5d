"""The batch-1 decode step as one native call (`CpuKernels.decode_stack`, `LlamaForCausalLM.native_decode_step`):
bitwise the logits of the model's Python forward, used exactly where every op of that step is native."""

from __future__ import annotations

import ctypes
from array import array
from typing import Optional

import pytest
import torch

from llmctl.engine import LLM, SamplingParams
from llmctl.engine.kernels import CPU_LIBRARY, CPU_SOURCES, FLAGS, build_library, load_cpu_kernels
from llmctl.engine.kernels.decode_stack import layout_mismatches
from tests.conftest import make_tiny_model

KERNELS = load_cpu_kernels()
needs_gemv = pytest.mark.skipif(KERNELS is None or not KERNELS.has_gemv,
                                reason="native CPU kernels with the bf16 GEMV (AVX512-BF16) unavailable here")

# window 8 < the contexts below, so it masks
ARCHS = {
    "llama": dict(head_dim=32),
    "mistral-window": dict(head_dim=32, sliding_window=8),
    "mistral-head-dim-16": dict(),  # the attention kernel's masked half rows
    "qwen2-bias-tied": dict(),
}


def test_the_ctypes_descriptors_mirror_common_h():
    """decode_stack.py's Structures and kinds against common.h's as the library compiled them (any x86 CPU: the
    layout function is built without AVX-512 too)."""
    library = build_library(CPU_SOURCES, FLAGS, "the layout check", CPU_LIBRARY)
    if library is None:
        pytest.skip("no C compiler, or the kernels are disabled")
    assert layout_mismatches(library) == []


def test_the_stack_descriptors_point_at_its_operands(monkeypatch):
    """DecodeStack's ctypes descriptors read back as C reads them, on any CPU (the native step is replaced by a
    function that reads the model and step structs): every address, size and chained quantised part in place."""
    from llmctl.engine.kernels import decode_stack, quant
    from llmctl.engine.kernels.decode_stack import DecodeStack, StackLayer, StackLinear, StackModel, StackStep

    hidden, heads, head_dim, intermediate, vocab, blocks, block_size = 32, 2, 16, 48, 40, 4, 8
    bf16 = dict(dtype=torch.bfloat16)
    pools = [torch.zeros(1, blocks, block_size, head_dim, **bf16) for _ in range(2)]
    weights = {name: torch.randn(rows, columns).to(**bf16) for name, (rows, columns) in
               dict(qkv=(4 * head_dim, hidden), o=(hidden, heads * head_dim), gate_up=(2 * intermediate, hidden),
                    down=(hidden, intermediate), lm_head=(vocab, hidden)).items()}
    layer = {"input_norm": torch.ones(hidden, **bf16), "qkv": ("gemv", weights["qkv"]), "qkv_bias": None,
             "o": ("gemv", weights["o"]), "o_bias": None, "post_norm": torch.ones(hidden, **bf16),
             "gate_up": ("gemv", weights["gate_up"]), "gate_up_bias": None, "down": ("gemv", weights["down"]),
             "down_bias": torch.zeros(hidden, **bf16), "k_pool": pools[0], "v_pool": pools[1]}
    kernels = quant.load_quant_kernels()
    if kernels is not None:  # the down linear in two parts: 4-bit rows (symmetric 8-bit codes 120..135), then 8-bit
        monkeypatch.setattr(quant, "PART_MIN_SAVED_BYTES", 0)
        codes = torch.cat([torch.randint(120, 136, (16, intermediate)), torch.randint(0, 256, (16, intermediate))])
        parts = kernels.pack_parts(codes.to(torch.uint8), torch.rand(hidden, intermediate // 16) + 0.1, None, 8, 16)
        assert len(parts.parts) == 2
        layer["down"] = ("quant", quant.QuantRowOperand(kernels, parts))
    table = torch.randn(64, head_dim // 2).to(**bf16)
    embedding, final_norm = torch.randn(vocab, hidden).to(**bf16), torch.ones(hidden, **bf16)
    seen = {}

    def read_back(model_address, step_address, logits, argmax, threads):
        model, step = StackModel.from_address(model_address), StackStep.from_address(step_address)
        layer_struct = StackLayer.from_address(model.layers)
        values = lambda address, count: list((ctypes.c_int64 * count).from_address(address))  # noqa: E731
        linears = {name: StackLinear.from_address(getattr(layer_struct, name)) for name in DecodeStack.LINEARS}
        seen.update(sizes=(model.num_layers, model.hidden, model.heads, model.kv_heads, model.head_dim,
                           model.intermediate, model.vocab, model.num_blocks, model.block_size, model.window),
                    eps=model.eps, embedding=model.embedding, lm_head=StackLinear.from_address(model.lm_head).weight,
                    norms=(layer_struct.input_norm, layer_struct.post_norm, layer_struct.qkv_bias,
                           layer_struct.down_bias), pools=(layer_struct.k_pool, layer_struct.v_pool),
                    linears={name: (s.kind, s.weight, s.rows) for name, s in linears.items()},
                    step=(step.tokens, values(step.token, 1), values(step.position, 1), values(step.slot, 1),
                          step.num_rows, values(step.tables, 2), values(step.lens, 1), step.starts, step.num_logits),
                    threads=threads)
        down = linears["down"]
        if down.next_part:
            second = StackLinear.from_address(down.next_part)
            seen["parts"] = [(p.kind, p.weight, p.bits, p.group, p.quant_gemv, p.quant_share, p.rows, p.next_part)
                             for p in (down, second)]
        return 1

    stack = DecodeStack(read_back, [layer], embedding, final_norm, ("gemv", weights["lm_head"]), table, table,
                        num_heads=heads, num_kv_heads=1, intermediate=intermediate, eps=1e-5, scale=0.25, window=None)
    logits, argmax = stack(array("q", [3]), array("q", [9]), array("q", [10]), [[2, 1, 0]], [11], [1], array("q", [0]))
    assert logits.shape == (1, vocab) and argmax is None
    assert seen["sizes"] == (1, hidden, heads, 1, head_dim, intermediate, vocab, blocks, block_size, 0)
    assert seen["eps"] == pytest.approx(1e-5) and seen["embedding"] == embedding.data_ptr()
    assert seen["lm_head"] == weights["lm_head"].data_ptr()
    assert seen["norms"] == (layer["input_norm"].data_ptr(), layer["post_norm"].data_ptr(), None,
                             layer["down_bias"].data_ptr())
    assert seen["pools"] == (pools[0].data_ptr(), pools[1].data_ptr())
    assert seen["step"] == (1, [3], [9], [10], 1, [2, 1], [11], None, 1)
    for name in ("qkv", "o", "gate_up"):
        assert seen["linears"][name] == (decode_stack.KINDS["gemv"], weights[name].data_ptr(),
                                         weights[name].shape[0])
    if kernels is not None:
        first, second = seen["parts"]
        assert [p[0] for p in (first, second)] == [decode_stack.KINDS["quant"]] * 2
        assert (first[1], first[2], first[6]) == (parts.parts[0].codes.data_ptr(), 4, 16)
        assert (second[1], second[2], second[6], second[7]) == (parts.parts[1].codes.data_ptr(), 8, 16, None)
        assert first[4] == kernels.chain_gemv_address and first[5] == kernels.share_gemv_address


def _engine(tmp_path, arch: str, engine: Optional[dict] = None, **overrides) -> LLM:
    folder = make_tiny_model(tmp_path / arch, arch.split("-")[0], **overrides)
    return _llm(folder, **(engine or {}))


def _llm(model, **engine) -> LLM:
    return LLM(str(model), dtype="bfloat16", skip_tokenizer_init=True, max_model_len=256,
               enable_prefix_caching=False, **({"num_threads": 1} | engine))


def _generate(llm: LLM, prompts):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=5)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]


class Counted:
    """The runner's native step, counting the tokens of each step it ran."""

    def __init__(self, stack):
        self.stack, self.steps = stack, []

    def can_run(self, *args):
        return self.stack.can_run(*args)

    def __call__(self, *args):
        self.steps.append(len(args[0]))
        return self.stack(*args)


@needs_gemv
@pytest.mark.parametrize("kind", ["amx", "gemv"])
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_the_native_step_gives_the_python_forwards_logits_bitwise(tmp_path, arch, kind, monkeypatch):
    from llmctl.engine.layers.quantization import base
    from llmctl.engine.layers.linear import OneDNNLinearMethod

    if kind == "amx" and not KERNELS.has_amx:
        pytest.skip("no AMX tiles here")
    if kind == "gemv":  # the dpbf16 GEMV's method (CPUs without AMX)
        monkeypatch.setattr(base, "select_linear_method",
                            lambda *args, **kwargs: OneDNNLinearMethod(16, KERNELS))
    llm = _engine(tmp_path, arch, **ARCHS[arch])
    runner = llm.engine.executor.runner
    stack = runner.native_decode
    assert stack is not None and stack.kinds == {kind}
    counted = runner.native_decode = Counted(stack)
    # 7 + 20 tokens cross a 16-token block; 30 + 20 cross three (and the 8-token window)
    prompts = [[(7 * i + 3) % 500 + 1 for i in range(7)], [(11 * i + 5) % 500 + 1 for i in range(30)]]
    native = [_generate(llm, [prompt])[0] for prompt in prompts]
    # every decode step of a lone sequence; with AMX the 7-token prefill too (rows of <= 8 tokens)
    assert counted.steps == ([7] if kind == "amx" else []) + [1] * 19 + [1] * 19
    counted.steps.clear()
    batched = _generate(llm, prompts)
    assert counted.steps == ([1 + 1] * 19 if kind == "amx" else [])  # two decodes a step: several rows on AMX only
    runner.native_decode = None
    assert [_generate(llm, [prompt])[0] for prompt in prompts] == native  # tokens and top-5 log-probs, bit for bit
    assert _generate(llm, prompts) == batched


def _check_one_token_steps_against_the_python_forward(llm: LLM, kinds: set[str]) -> None:
    """Every batch-1 decode step runs natively, nothing else does (quantised linears: one row a step), and
    the tokens and top-5 log-probs equal the Python forward's bit for bit."""
    runner = llm.engine.executor.runner
    stack = runner.native_decode
    assert stack is not None and stack.kinds == kinds and stack.max_tokens == 1
    counted = runner.native_decode = Counted(stack)
    prompts = [[(7 * i + 3) % 500 + 1 for i in range(7)], [(11 * i + 5) % 500 + 1 for i in range(30)]]
    native = [_generate(llm, [prompt])[0] for prompt in prompts]
    assert counted.steps == [1] * 19 + [1] * 19
    counted.steps.clear()
    batched = _generate(llm, prompts)
    assert counted.steps == []  # two decodes a step: the Python forward
    runner.native_decode = None
    assert [_generate(llm, [prompt])[0] for prompt in prompts] == native
    assert _generate(llm, prompts) == batched


@needs_gemv
@pytest.mark.parametrize("quantization", ["int8", "int4-g32", "int4-g32-asym"])
@pytest.mark.parametrize("arch", ["llama", "qwen2-bias-tied"])
def test_on_the_fly_quantised_linears_run_in_the_native_step_bitwise(tmp_path, arch, quantization):
    llm = _engine(tmp_path, arch, dict(quantization=quantization), **({"head_dim": 32} if arch == "llama" else {}))
    _check_one_token_steps_against_the_python_forward(llm, {"quant"})  # the tied lm_head quantised too


@needs_gemv
@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("linears", ["gemv", "int4-g32", "int8"])
def test_the_one_region_step_is_bitwise_the_forward_on_several_threads(tmp_path, monkeypatch, linears, threads):
    # a one-token step whose linears all have a one-row share kernel runs in one parallel region, its threads
    # meeting at spin barriers: each thread's shares, KV heads and copies must give the forward's logits bit for
    # bit, three threads on this host's cores too (uneven shares of the rows and of the 2 KV heads, threads
    # descheduled at a barrier)
    from llmctl.engine.layers.quantization import base
    from llmctl.engine.layers.linear import OneDNNLinearMethod

    if linears == "gemv":
        monkeypatch.setattr(base, "select_linear_method",
                            lambda *args, **kwargs: OneDNNLinearMethod(16, KERNELS))
    engine = dict(num_threads=threads) | ({} if linears == "gemv" else dict(quantization=linears))
    previous = torch.get_num_threads()
    try:
        llm = _engine(tmp_path, "llama", engine, head_dim=32)
        _check_one_token_steps_against_the_python_forward(llm, {"gemv" if linears == "gemv" else "quant"})
    finally:
        torch.set_num_threads(previous)


@needs_gemv
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_one_region_step_finds_its_logits_argmax(tmp_path, monkeypatch, threads):
    # each thread takes the argmax of the logits slice it wrote; combined, torch.argmax's answer (the first maximum,
    # else the first NaN) where the maxima and NaNs lie in different threads' slices (vocab 512: slices of 256 or
    # ~171), and the greedy sampler uses it instead of reading the logits again
    from llmctl.engine.layers.quantization import base
    from llmctl.engine.layers.linear import OneDNNLinearMethod

    monkeypatch.setattr(base, "select_linear_method", lambda *args, **kwargs: OneDNNLinearMethod(16, KERNELS))
    previous = torch.get_num_threads()
    try:
        llm = _engine(tmp_path, "llama", dict(num_threads=threads), head_dim=32)
        runner = llm.engine.executor.runner
        stack, weight = runner.native_decode, runner.model.lm_head.weight

        def step() -> tuple[torch.Tensor, list[int]]:
            one = array("q", [1])
            logits, argmax = stack(one, one, one, [[0]], [2], [1], array("q", [0]))
            return logits[0].clone(), argmax  # the stack's buffer: the next step writes it again

        logits, argmax = step()
        assert argmax == [int(logits.argmax())]
        top = weight[int(logits.argmax())].clone()  # a row whose logit is positive
        with torch.no_grad():
            weight.zero_()
            weight[200], weight[400] = top, top  # two equal maxima in two slices
            logits, argmax = step()
            assert argmax == [200] and logits[200] > 0 and torch.count_nonzero(logits) == 2
            weight[400] = 2 * top
            assert step()[1] == [400]
            weight[100], weight[400] = float("nan"), float("nan")  # a NaN wins, the first of them
            logits, argmax = step()
            assert argmax == [100] and logits[100].isnan() and logits[400].isnan()
            weight[100] = top
            assert step()[1] == [400]
            weight.zero_()
            assert step()[1] == [0]  # all equal
    finally:
        torch.set_num_threads(previous)


@needs_gemv
def test_the_greedy_sampler_takes_the_native_steps_argmax(tmp_path, monkeypatch):
    from llmctl.engine.layers.quantization import base
    from llmctl.engine import sampler as sampler_module
    from llmctl.engine.layers.linear import OneDNNLinearMethod

    monkeypatch.setattr(base, "select_linear_method", lambda *args, **kwargs: OneDNNLinearMethod(16, KERNELS))
    llm = _engine(tmp_path, "llama", dict(num_threads=2), head_dim=32)
    prompts = [[(7 * i + 3) % 500 + 1 for i in range(7)], [(11 * i + 5) % 500 + 1 for i in range(30)]]
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    with monkeypatch.context() as patched:
        argmaxes = []
        patched.setattr(sampler_module, "row_argmax", lambda logits: argmaxes.append(len(logits)) or
                        logits.argmax(dim=-1).tolist())
        native = [llm.generate([prompt], greedy)[0].outputs[0].token_ids for prompt in prompts]
        assert argmaxes == [1, 1]  # each prompt's first token (sampled after its prefill): the decodes found theirs
    runner = llm.engine.executor.runner
    runner.native_decode = None
    assert [llm.generate([prompt], greedy)[0].outputs[0].token_ids for prompt in prompts] == native


@needs_gemv
@pytest.mark.parametrize("arch, default_type, types", [
    ("llama", "Q4_0", {}), ("qwen2", "Q4_0", {}),
    # 5-bit types as 8-bit codes, a Q4_0 v widened into its 8-bit qkv, an asymmetric Q5_1 down_proj
    ("llama", "Q5_0", {"attn_v.weight": "Q4_0", "ffn_down.weight": "Q5_1"})])
def test_a_gguf_files_step_runs_natively_bitwise(tiny_models, tmp_path, arch, default_type, types):
    from gguf_writer import write_gguf

    path = tmp_path / f"model-{default_type}.gguf"
    write_gguf(tiny_models[arch], path, types, default_type=default_type)
    llm = _llm(path)
    # llama: its own output matrix; qwen2: tied, the lm_head from the embedding's Q4_0 codes
    _check_one_token_steps_against_the_python_forward(llm, {"quant"})


@needs_gemv
@pytest.mark.parametrize("default_type, narrow", [("Q4_0", 4), ("IQ4_NL", "iq4")])
def test_a_fused_layer_in_parts_runs_natively_bitwise(tiny_models, tmp_path, monkeypatch, default_type, narrow):
    """q/k of 4-bit (or IQ4) codes beside a Q8_0 v: one 8-bit qkv weight, kept by the kernels as two parts (every
    split taken here, however few bytes it saves), in the native step as in the Python forward."""
    from gguf_writer import write_gguf

    from llmctl.engine.kernels import quant

    monkeypatch.setattr(quant, "PART_MIN_SAVED_BYTES", 0)
    path = tmp_path / f"model-{default_type}.gguf"
    write_gguf(tiny_models["llama"], path, {"attn_v.weight": "Q8_0"}, default_type=default_type)
    llm = _llm(path)
    qkv = llm.engine.executor.runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.quant_bits == 8
    assert [part.bits for part in qkv.kernel_parts.parts] == [quant.IQ4_CODES if narrow == "iq4" else 4, 8]
    _check_one_token_steps_against_the_python_forward(llm, {"quant"})


@needs_gemv
@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_a_pre_quantised_checkpoints_step_mixes_quantised_and_bf16_linears(tiny_models, tmp_path, method):
    from test_gptq_awq import Scheme, write_quantised_checkpoint

    write_quantised_checkpoint(tiny_models["llama"], tmp_path / method, Scheme(method, sym=False))
    llm = _llm(tmp_path / method)
    bf16 = "amx" if KERNELS.has_amx else "gemv"  # GPTQ's and AWQ's lm_head stays in full precision
    _check_one_token_steps_against_the_python_forward(llm, {"quant", bf16})


@needs_gemv
def test_verify_rows_run_natively_and_give_the_python_forwards_logits(tmp_path):
    if not KERNELS.has_amx:
        pytest.skip("several rows a step run natively on the AMX linears only")
    folder = make_tiny_model(tmp_path / "llama", "llama", head_dim=32)
    llm = LLM(str(folder), dtype="bfloat16", skip_tokenizer_init=True, max_model_len=256, num_threads=1,
              enable_prefix_caching=False,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                                  "prompt_lookup_min": 1})
    runner = llm.engine.executor.runner
    counted = runner.native_decode = Counted(runner.native_decode)
    prompt = [5, 6, 7, 8, 9] * 6  # a repeating prompt: the n-gram proposer drafts
    native = _generate(llm, [prompt])
    assert 5 in counted.steps  # verify rows of 1 + 4 tokens ran natively
    runner.native_decode = None
    assert _generate(llm, [prompt]) == native


@pytest.mark.parametrize("arch, overrides, engine", [
    ("qwen3", dict(), dict(dtype="bfloat16")),  # q/k norm
    ("llama", dict(head_dim=32), dict(dtype="float32", quantization="int8")),  # float32 activations: int8pack
    ("llama", dict(head_dim=32), dict(dtype="float32")),
])
def test_the_native_step_is_only_built_where_every_op_is_native(tmp_path, arch, overrides, engine):
    folder = make_tiny_model(tmp_path / arch, arch, **overrides)
    llm = LLM(str(folder), skip_tokenizer_init=True, max_model_len=128, num_threads=1, **engine)
    assert llm.engine.executor.runner.native_decode is None


def test_act_order_linears_keep_the_python_forward(tiny_models, tmp_path):
    from test_gptq_awq import Scheme, write_quantised_checkpoint

    write_quantised_checkpoint(tiny_models["llama"], tmp_path / "gptq", Scheme("gptq", desc_act=True))
    assert _llm(tmp_path / "gptq").engine.executor.runner.native_decode is None  # inputs permuted first


@needs_gemv
def test_the_steps_logits_are_one_plain_buffer(tmp_path):
    # the step writes its logits into the stack's one buffer (no tensor allocated per step; [max_tokens, vocab],
    # not one per row count), a plain tensor even when the first step ran in inference mode (the sampler may read
    # it outside), and the next step writes it again
    llm = _engine(tmp_path, "llama", head_dim=32)
    stack = llm.engine.executor.runner.native_decode
    with torch.inference_mode():
        first, _ = stack(array("q", [1]), array("q", [1]), array("q", [1]), [[0]], [2], [1], array("q", [0]))
    assert not first.is_inference() and first.shape == (1, stack.vocab)
    kept = first.clone()
    second, _ = stack(array("q", [2]), array("q", [1]), array("q", [1]), [[0]], [2], [1], array("q", [0]))
    assert second is first and not torch.equal(second, kept)  # another token, the same buffer
    assert first.untyped_storage().nbytes() == 4 * stack.max_tokens * stack.vocab  # rows of one [max_tokens, vocab]


@needs_gemv
def test_the_step_refuses_ids_outside_its_tables(tmp_path):
    llm = _engine(tmp_path, "llama", head_dim=32)
    stack = llm.engine.executor.runner.native_decode
    one, zero = array("q", [1]), array("q", [0])
    with pytest.raises(ValueError, match="outside"):
        stack(array("q", [512]), one, one, [[0]], [2], [1], zero)  # token id = vocab size
    with pytest.raises(ValueError, match="outside"):
        stack(one, one, one, [[0]], [17], [1], zero)  # a 17-token context needs two blocks
    with pytest.raises(ValueError, match="outside"):
        stack(one, one, one, [[stack.num_blocks]], [2], [1], zero)
    with pytest.raises(ValueError, match="outside"):
        stack(one, one, one, [[0]], [2], [1], one)  # logits of a token the step does not have
    for not_int64 in (array("i", [1]), [1], torch.tensor([1])):
        with pytest.raises(ValueError, match="int64 arrays"):
            stack(not_int64, one, one, [[0]], [2], [1], zero)
    with pytest.raises(ValueError, match="do not fit"):
        stack(one, one, one, [[0]], [2], [2], zero)  # rows of more tokens than the step holds
    with pytest.raises(ValueError, match="do not fit"):
        stack(one, one, one, [[0]], [2], [1], array("q", [0, 0]))  # more logits rows than tokens


@needs_gemv
def test_operands_are_checked_when_the_step_is_bound():
    from llmctl.engine.kernels.quant import QuantRowOperand, load_quant_kernels

    hidden, heads, kv_heads, dim, inter, vocab = 64, 2, 1, 32, 96, 40
    bf16 = dict(dtype=torch.bfloat16)
    pool = torch.zeros(kv_heads, 4, 16, dim, **bf16)
    layer = {"input_norm": torch.ones(hidden, **bf16),
             "qkv": ("gemv", torch.zeros((heads + 2 * kv_heads) * dim, hidden, **bf16)), "qkv_bias": None,
             "o": ("gemv", torch.zeros(hidden, heads * dim, **bf16)), "o_bias": None,
             "post_norm": torch.ones(hidden, **bf16), "gate_up": ("gemv", torch.zeros(2 * inter, hidden, **bf16)),
             "gate_up_bias": None, "down": ("gemv", torch.zeros(hidden, inter, **bf16)), "down_bias": None,
             "k_pool": pool, "v_pool": pool.clone()}
    embedding, table = torch.zeros(vocab, hidden, **bf16), torch.zeros(64, dim // 2, **bf16)
    args = dict(num_heads=heads, num_kv_heads=kv_heads, intermediate=inter, eps=1e-5, scale=dim ** -0.5, window=None)
    quant = load_quant_kernels()
    codes = torch.full((vocab, hidden), 8, dtype=torch.uint8)  # 4-bit codes at the midpoint: weight 0
    lm_heads = [("gemv", embedding)]
    if quant is not None:
        lm_heads.append(("quant", QuantRowOperand(quant, quant.pack_parts(codes, torch.ones(vocab, 2), None, 4, 32))))
    for lm_head in lm_heads:
        stack = KERNELS.decode_stack([layer], embedding, torch.ones(hidden, **bf16), lm_head, table, table, **args)
        logits, argmax = stack(array("q", [3]), array("q", [0]), array("q", [0]), [[0]], [1], [1], array("q", [0]))
        assert logits.shape == (1, vocab) and logits.dtype == torch.float32 and not logits.any()  # zero weights
        assert argmax in ([0], None)  # found by the one-region step (a lone layer whose linears all are GEMVs)
    bad_operands = [("o", ("gemv", layer["o"][1].t())), ("qkv_bias", torch.zeros(7, **bf16)),
                    ("down", ("gemv", layer["down"][1].float())), ("down", layer["down"][1]),
                    ("down", ("tiles", layer["down"][1]))]
    if quant is not None:
        bad_operands.append(("o", lm_heads[1]))  # a quantised weight of another shape
    for name, bad in bad_operands:
        with pytest.raises(ValueError, match=f"decode_stack: {name} must"):
            KERNELS.decode_stack([{**layer, name: bad}], embedding, torch.ones(hidden, **bf16), lm_heads[0], table,
                                 table, **args)
    with pytest.raises(ValueError, match="lm_head"):
        KERNELS.decode_stack([layer], embedding, torch.ones(hidden, **bf16), ("gemv", embedding[:-1]), table, table,
                             **args)
