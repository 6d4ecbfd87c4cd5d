"""The model side as the engine sees it: the `Executor` protocol (abstract.py), the in-process
`UniProcExecutor` (uniproc_executor.py) and the tensor-parallel `MultiprocExecutor` (multiproc_executor.py).
Import the modules themselves; this package re-exports nothing (the multi-process one pulls in more).
"""
