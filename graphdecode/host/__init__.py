"""The host side: requests in, plans out, outputs back.

LLM (the Python front end) -> Engine (schedule -> launch -> postprocess) with its inputs
(validation, tokenization, constraint compiles), scheduler (admission, pages, preemption,
lookahead), page pool (prefix cache), waiting queue and sequences (request state as
counters), and the output processing (detokenizer, stop strings, deltas). It speaks to the
device only through plans (graphdecode/plan.py) handed to an executor (graphdecode/device).
"""
