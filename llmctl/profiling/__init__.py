"""Profiling behind `llmctl profile`: py-spy, memray, torch.profiler and leak hunting."""
