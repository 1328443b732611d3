"""Helpers the tests share, importable from every folder of tests/ (pytest puts tests/ on sys.path: the
`pythonpath` option in pyproject.toml). Fixtures live in conftest.py (tests/ for every test, a folder's own
conftest.py for that folder's); what a test calls as a function lives here:

  models       tiny random models and a tokenizer: build_tiny (the conftest fixtures' models), build_gemma,
               hf_llama / hf_opt (plain `transformers` models), make_tokenizer, CORPUS, perturb
  cli          REPO (the checkout's root) and one_line_error (how bad input must be reported)
  speculation  random skew matrices and tokens, a selection recorder, prefill-then-decode (InfiniGen's tests)
  offload      the offloading engine's run, its test policies, a fixed-order allocator, a counter of the bytes
               read from the slow tier
  packed_rows  decoding with selections read as rows packed per batch row (the sparse attention's tests)
"""
