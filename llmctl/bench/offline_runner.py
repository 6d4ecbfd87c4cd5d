"""What `llmctl bench throughput` / `bench latency` do once their flags are parsed: validate the
workload against the model's config, run the engine (and transformers with --compare-hf), build
the JSON document, render it. The measuring itself is in `offline` and `hf_compare`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from llmctl.bench import offline
from llmctl.bench.cost import cost_figures
from llmctl.bench.report import progress_bar, render_latency, render_throughput, status
from llmctl.errors import UserError
from llmctl.output import print_json


@dataclass
class ThroughputJob:
    num_prompts: Optional[int]
    input_len: int
    output_len: int
    range_ratio: float
    dataset: Optional[Path]
    repeats: int
    workload_seed: int
    compare_hf: bool
    hf_batch_size: int
    json_output: bool
    price_per_hour: Optional[float] = None
    monthly_request_rate: Optional[float] = None


@dataclass
class LatencyJob:
    batch_size: int
    input_len: int
    output_len: int
    warmup_iters: int
    iters: int
    workload_seed: int
    compare_hf: bool
    json_output: bool


def run_throughput_job(args: Any, job: ThroughputJob) -> None:
    info = offline.model_info(args)
    requests, workload = _throughput_workload(args, job, info)
    _check_hf_available(job.compare_hf)
    with status("Loading model"):
        engine = offline.load_engine(args)
    with progress_bar(True) as update:
        times = offline.run_throughput(engine, requests, job.repeats, update)
    doc = {**offline.header("throughput", info, args, engine), "workload": {**workload, **_tokens(times)},
           **_throughput_figures(times), "spec_decode": offline.spec_decode_figures(args, times.spec_decode),
           "transformers": None, "ratio_vs_transformers": None}
    if job.compare_hf:
        hf_times, version = _hf_throughput(engine, info, args, requests, job)
        doc["transformers"] = {"version": version, "batch_size": job.hf_batch_size, **_throughput_figures(hf_times)}
        doc["ratio_vs_transformers"] = {key: doc[key]["mean"] / doc["transformers"][key]["mean"]
                                        for key in ("output_tokens_per_second", "requests_per_second",
                                                    "total_tokens_per_second")}
    if job.price_per_hour is not None:
        doc["cost"] = cost_figures(job.price_per_hour, requests_per_s=doc["requests_per_second"]["mean"],
                                   output_tokens_per_s=doc["output_tokens_per_second"]["mean"],
                                   total_tokens_per_s=doc["total_tokens_per_second"]["mean"],
                                   monthly_request_rate=job.monthly_request_rate)
    offline.release(engine)
    if job.json_output:
        print_json(doc)
    else:
        render_throughput(doc)


def _throughput_workload(args: Any, job: ThroughputJob, info: offline.ModelInfo) -> tuple[list, dict]:
    if job.dataset is not None:
        if job.range_ratio:
            raise UserError("--range-ratio applies to random prompts, not to --dataset")
        if job.output_len < 1:
            raise UserError(f"--output-len must be >= 1, got {job.output_len}")
        folder = Path(args.tokenizer) if args.tokenizer else info.folder
        requests = offline.dataset_requests(job.dataset, folder, job.output_len, job.num_prompts, info)
        return requests, {"source": f"dataset:{job.dataset}", "num_prompts": len(requests),
                          "output_len": job.output_len}
    offline.check_lengths(job.input_len, job.output_len, job.range_ratio, info.max_model_len, info.label)
    count = job.num_prompts or 100
    requests = offline.random_requests(count, job.input_len, job.output_len, job.range_ratio, info.vocab_size,
                                       job.workload_seed)
    return requests, {"source": "random", "num_prompts": count, "input_len": job.input_len,
                      "output_len": job.output_len, "range_ratio": job.range_ratio, "seed": job.workload_seed}


def _tokens(times: offline.PassTimes) -> dict[str, int]:
    return {"prompt_tokens": times.prompt_tokens, "output_tokens": times.output_tokens}


def _throughput_figures(times: offline.PassTimes) -> dict[str, Any]:
    """vLLM's keys (elapsed_time, num_requests, total_num_tokens, requests_per_second) plus output and
    total token rates, each as mean/std over the passes."""
    return {"elapsed_time": sum(times.seconds) / len(times.seconds), "elapsed_times": times.seconds,
            "num_requests": times.num_requests, "total_num_tokens": times.prompt_tokens + times.output_tokens,
            "repeats": len(times.seconds), **times.rates()}


def _check_hf_available(wanted: bool) -> None:
    """Fail before the (slow) engine run when --compare-hf cannot work."""
    if not wanted:
        return
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        raise UserError("--compare-hf needs transformers: pip install transformers")


def _hf_model(engine: offline.EngineRun, info: offline.ModelInfo, args: Any):
    from llmctl.bench import hf_compare

    device, dtype = engine.device, engine.dtype
    offline.release(engine)  # one model in memory at a time
    with status("Loading the model in transformers"):
        return hf_compare.load_hf(info.folder, args.load_format, dtype, device, args.seed)


def _hf_throughput(engine, info, args, requests, job: ThroughputJob):
    from llmctl.bench import hf_compare

    hf = _hf_model(engine, info, args)
    with progress_bar(True) as update:
        times = hf_compare.hf_throughput(hf, requests, job.hf_batch_size, job.repeats, update)
    hf_compare.release(hf)
    return times, hf.version


def run_latency_job(args: Any, job: LatencyJob) -> None:
    info = offline.model_info(args)
    offline.check_lengths(job.input_len, job.output_len, 0.0, info.max_model_len, info.label)
    max_num_seqs = args.with_device_defaults(offline.device_type(args)).max_num_seqs
    if job.batch_size > max_num_seqs:
        raise UserError(f"--batch-size {job.batch_size} exceeds --max-num-seqs {max_num_seqs}: the batch "
                        "would not run as one; raise --max-num-seqs")
    requests = offline.random_requests(job.batch_size, job.input_len, job.output_len, 0.0, info.vocab_size,
                                       job.workload_seed)
    _check_hf_available(job.compare_hf)
    with status("Loading model"):
        engine = offline.load_engine(args)
    with progress_bar(True) as update:
        latencies, spec = offline.run_latency(engine, requests, job.warmup_iters, job.iters, update)
    workload = {"batch_size": job.batch_size, "input_len": job.input_len, "output_len": job.output_len,
                "num_iters_warmup": job.warmup_iters, "num_iters": job.iters, "seed": job.workload_seed,
                "prompt_tokens": job.batch_size * job.input_len, "output_tokens": job.batch_size * job.output_len}
    doc = {**offline.header("latency", info, args, engine), "workload": workload, **_latency_figures(latencies),
           "spec_decode": offline.spec_decode_figures(args, spec), "transformers": None, "ratio_vs_transformers": None}
    if job.compare_hf:
        from llmctl.bench import hf_compare

        hf = _hf_model(engine, info, args)
        with progress_bar(True) as update:
            hf_latencies = hf_compare.hf_latency(hf, requests, job.warmup_iters, job.iters, update)
        hf_compare.release(hf)
        doc["transformers"] = {"version": hf.version, **_latency_figures(hf_latencies)}
        # > 1 means llmctl is faster: transformers' mean latency over ours.
        doc["ratio_vs_transformers"] = {"speedup_mean_latency": doc["transformers"]["avg_latency"] / doc["avg_latency"]}
    offline.release(engine)
    if job.json_output:
        print_json(doc)
    else:
        render_latency(doc)


def _latency_figures(latencies: list[float]) -> dict[str, Any]:
    """vLLM's keys: avg_latency, latencies, percentiles; plus std_latency."""
    stats = offline.mean_std(latencies)
    return {"avg_latency": stats["mean"], "std_latency": stats["std"], "latencies": latencies,
            "percentiles": offline.percentiles(latencies)}
