"""Fail-stop failover techniques: MeCeFO (neighbor-do-both) and SPARe (stacked redundant shards with
adaptive reordering). Pure-Python/numpy/scipy planning code lives in ``spare``; runtimes that drive
torchft sit next to it."""
