"""benchmarks/serve_load.py without a server: the numbers it computes from recorded timestamps (TTFT, ITL,
percentiles, the document and join summaries), its tables, and the command lines it starts each system with."""
from __future__ import annotations

import pytest


def test_percentiles_are_nearest_rank(sl):
    xs = [float(i) for i in range(1, 101)]  # 1..100, shuffled order must not matter
    assert sl.pct(list(reversed(xs)), 50) == 51.0  # index round(0.5 * 99) = 50 (banker's rounding: 49.5 -> 50)
    assert sl.pct(xs, 99) == 99.0
    assert sl.pct(xs, 100) == 100.0 and sl.pct(xs, 0) == 1.0
    assert sl.pct([7.0], 99) == 7.0
    assert sl.pct([], 50) != sl.pct([], 50)  # nan


def test_ttft_itl_and_tokens_from_timestamps(sl):
    r = sl.Sent(sent=10.0, arrivals=[10.5, 10.6, 10.8, 11.1], done=11.2)
    assert r.ttft == pytest.approx(0.5)
    assert r.itls() == pytest.approx([0.1, 0.2, 0.3])
    assert r.tokens == 4  # no usage: the chunks that carried text
    r.completion_tokens = 5  # the server's count wins (a chunk may carry two tokens' text)
    assert r.tokens == 5
    assert sl.Sent(sent=1.0).ttft is None and sl.Sent(sent=1.0).itls() == []


def test_summarize(sl):
    a = sl.Sent(sent=0.0, arrivals=[1.0, 1.1, 1.2], done=1.3, completion_tokens=3, prompt_tokens=512)
    b = sl.Sent(sent=0.5, arrivals=[3.5, 3.6, 4.6], done=4.7, completion_tokens=3, prompt_tokens=510)
    bad = sl.Sent(sent=0.2, arrivals=[0.9, 5.9], error="APIConnectionError()")  # cut mid-stream
    s = sl.summarize([a, b, bad], wall=2.0)
    assert s["requests"] == 2 and s["errors"] == 1 and s["error_samples"] == ["APIConnectionError()"]
    assert s["requests_per_s"] == pytest.approx(1.0)
    assert s["tokens_per_s"] == pytest.approx(3.0)  # 6 tokens of the two that succeeded, over 2 s
    assert s["ttft_p50_s"] == pytest.approx(1.0) and s["ttft_p99_s"] == pytest.approx(3.0)
    # gaps 0.1, 0.1, 0.1, 1.0 (the failed request's are not counted)
    assert s["itl_samples"] == 4
    assert s["itl_p50_s"] == pytest.approx(0.1) and s["itl_p99_s"] == pytest.approx(1.0)
    assert s["prompt_tokens_mean"] == 511 and s["completion_tokens_mean"] == 3


def test_document_summary(sl):
    first = [sl.Sent(sent=0.0, arrivals=[10.0])]
    rest = [sl.Sent(sent=20.0 + i, arrivals=[20.0 + i + t]) for i, t in enumerate((0.5, 0.9, 0.7))]
    d = sl.document_summary(first, rest)
    assert d["ttft_first_s"] == 10.0 and d["questions"] == 4 and d["errors"] == 0
    assert d["ttft_rest_median_s"] == pytest.approx(0.7) and d["ttft_rest_max_s"] == pytest.approx(0.9)
    assert d["ratio_median"] == pytest.approx(0.07) and d["ratio_max"] == pytest.approx(0.09)
    failed = sl.document_summary([sl.Sent(sent=0.0, error="boom")], rest)
    assert failed["ttft_first_s"] is None and failed["ratio_median"] is None and failed["errors"] == 1


def test_join_window_catches_the_stall(sl):
    # two streams decode every 0.1 s; the join is sent at 1.05 and its first token comes at 3.0; the streams
    # stall from 1.0 to 3.1 (the prefill), then go on
    def stream(offset):
        times = [offset + 0.1 * i for i in range(11)] + [3.1 + offset] + [3.1 + offset + 0.1 * i for i in range(1, 6)]
        return sl.Sent(sent=0.0, arrivals=times)

    alone = [sl.Sent(sent=0.0, arrivals=[0.1 * i for i in range(30)]) for _ in range(2)]
    streams = [stream(0.0), stream(0.01)]
    join = sl.Sent(sent=1.05, arrivals=[3.0, 3.2])
    during = sl.itls_overlapping(streams, join.sent, join.arrivals[0])
    assert sorted(during) == pytest.approx([2.1, 2.1])  # only the stalled gaps overlap [1.05, 3.0]
    j = sl.join_summary(alone, streams, join)
    assert j["joined"] and j["join_ttft_s"] == pytest.approx(1.95)
    assert j["itl_alone_p50_s"] == pytest.approx(0.1) and j["itl_alone_samples"] == 58
    assert j["itl_join_p99_s"] == pytest.approx(2.1) and j["itl_join_max_s"] == pytest.approx(2.1)
    assert j["p99_over_alone_p50"] == pytest.approx(21.0)
    assert sl.join_summary(alone, streams, None)["joined"] is False


def test_llama_server_runs_our_threads_slots_and_gguf(sl, tmp_path):
    gguf = tmp_path / "model.Q4_1.gguf"
    sy = sl.Systems(bin_dir=tmp_path / "bin", gguf=gguf, threads=3, flags=set(), logs=tmp_path)
    llama, _ = sy.llama(8, 640)  # not entered: no process is started
    ours, _ = sy.ours("infinigen", 8)

    def flag(argv, name):
        return argv[argv.index(name) + 1]

    assert llama[0] == str(tmp_path / "bin" / "llama-server")
    assert flag(llama, "-m") == str(gguf) and flag(llama, "-t") == "3"
    assert flag(llama, "-np") == flag(ours, "--max-batch") == "8"
    ctx = int(flag(llama, "-c"))
    assert ctx % 8 == 0 and ctx // 8 >= 640  # every slot holds the longest request
    assert flag(llama, "--host") == flag(ours, "--host") == "127.0.0.1"
    assert "--model" not in ours  # ours serves the default model, whose GGUF is the one llama-server gets
    assert flag(ours, "--policy") == "infinigen"
    assert sl.child_env(3)["OMP_NUM_THREADS"] == "3"  # ours: torch's threads
    assert sl.ctx_per_slot(8008) == 8192 and sl.ctx_per_slot(100) == 256


def test_serve_flags_from_help(sl):
    assert sl.serve_flags("--policy TEXT  --max-batch INTEGER") == set()
    assert sl.serve_flags("│ --prefix-cache-dir  TEXT │") == {"--prefix-cache-dir"}  # not --prefix-cache
    assert sl.serve_flags("--prefix-cache / --no-prefix-cache\n--prefix-cache-dir DIR\n--prefill-chunk-layers N") == {
        "--prefix-cache", "--prefix-cache-dir", "--prefill-chunk-layers"}
    assert sl.serve_flags("--prefill-chunk-layers N") == {"--prefill-chunk-layers"}


def _chat_row(sl, system, tps):
    return {"system": system, "requests": 24, "errors": 0, "requests_per_s": 0.5, "tokens_per_s": tps,
            "ttft_p50_s": 1.234, "ttft_p99_s": 2.5, "itl_p50_s": 0.0456, "itl_p99_s": 0.3, "prompt_tokens_mean": 512,
            "completion_tokens_mean": 128, "others_cpu_share": 0.25}


def test_tables_render(sl):
    chat = sl.chat_table([_chat_row(sl, "llama-server", 100.0), _chat_row(sl, "ours, full cache", 150.0)])
    assert chat[2] == "| llama-server | 24 | 0 | 0.50 | 100.0 | 1.23 s | 2.50 s | 46 ms | 300 ms | 512 / 128 |"
    doc = sl.document_table([
        {"system": "ours", "questions": 20, "errors": 0, "ttft_first_s": 4.0, "ttft_rest_median_s": 0.2,
         "ttft_rest_max_s": 0.5, "ratio_median": 0.05, "ratio_max": 0.125},
        {"system": "ours, --prefix-cache", "unsupported": "`--prefix-cache`"}])
    assert doc[2] == "| ours | 20 | 0 | 4.00 s | 0.20 s | 0.50 s | 0.05 | 0.12 |"
    assert "not supported by this build" in doc[3]
    join = sl.join_table([
        {"system": "ours", "joined": True, "itl_alone_p50_s": 0.05, "itl_alone_p99_s": 0.08, "itl_join_p50_s": 0.06,
         "itl_join_p99_s": 2.0, "itl_join_max_s": 2.0, "p99_over_alone_p50": 40.0, "join_ttft_s": 2.1,
         "itl_join_samples": 4},
        {"system": "ours, --prefill-chunk", "unsupported": "`--prefill-chunk`"}])
    assert join[2] == "| ours | 50 ms | 80 ms | 60 ms | 2000 ms | 2000 ms | 40.00 | 2.10 s | 4 |"
    assert "not supported by this build" in join[3]


def test_render_keeps_other_sections(sl):
    chat = {"params": {"clients": 8, "rounds": 3, "prompt_tokens": 512, "max_tokens": 128},
            "rows": [_chat_row(sl, "llama-server", 100.0), _chat_row(sl, "ours, full cache", 150.0)],
            "commands": ["llama-server -m x.gguf -t 2 -np 8", "infinigen serve --max-batch 8"],
            "llama_tokens_per_s": 100.0, "date": "2026-11-23 23:00", "threads": 2, "quick": False,
            "machine": {"cpu": "Xeon", "cores": 2}, "argv": "python benchmarks/serve_load.py --scenario chat"}
    md = sl.render({"model": "M", "peer": {"chat": chat}})
    assert md.startswith("# `infinigen serve` under load (M)")
    assert "ours, full cache: 1.50x llama-server's tokens/s" in md
    assert "noisy (shared CPU): other processes took llama-server 25%" in md
    assert "    python benchmarks/serve_load.py --scenario chat" in md
    assert "### One document" not in md and "## Alone, in process" not in md  # only what was run


def test_quick_and_scenarios(sl):
    a = sl.parse_args(["--scenario", "chat,join", "--quick", "--chat-clients", "3"])
    assert a.scenarios == ["chat", "join"]
    assert a.chat_clients == 3  # given explicitly: --quick leaves it
    assert a.chat_prompt == sl.QUICK["chat_prompt"] and a.join_prompt == sl.QUICK["join_prompt"]
    assert sl.parse_args([]).scenarios == list(sl.SCENARIOS)
    with pytest.raises(SystemExit):
        sl.parse_args(["--scenario", "chats"])
    with pytest.raises(SystemExit):
        sl.parse_args(["--join-after", "300", "--stream-tokens", "256"])


class _FakePrompts:
    def passage(self, book, start, n):
        return "word " * n

    def length(self, content):
        return len(content.split())


def test_document_restart_runs_two_servers_on_one_cache_folder(sl, tmp_path, monkeypatch):
    """The orchestration of `document` with a serve that has the prefix-cache flags, without processes: request 1
    goes to one server, requests 2.. to a second one started with the same --prefix-cache-dir."""
    started, asked = [], []

    import contextlib

    @contextlib.contextmanager
    def fake_server(argv, port, env, log, ready_s=900):
        started.append(argv)
        yield f"server{len(started)}"

    def fake_stream(client, model, messages, max_tokens, on_token=None):
        asked.append((client, messages[0]["content"].split()[-1]))
        return sl.Sent(sent=0.0, arrivals=[1.0, 1.1], completion_tokens=2, prompt_tokens=60)

    monkeypatch.setattr(sl, "server", fake_server)
    monkeypatch.setattr(sl, "openai_client", lambda url: url)
    monkeypatch.setattr(sl, "served_model", lambda client: "m")
    monkeypatch.setattr(sl, "warm_up", lambda client, model: None)
    monkeypatch.setattr(sl, "stream_chat", fake_stream)
    sy = sl.Systems(bin_dir=tmp_path, gguf=tmp_path / "m.gguf", threads=2, logs=tmp_path,
                    flags={"--prefix-cache", "--prefix-cache-dir"})
    args = sl.parse_args(["--questions", "3", "--doc-tokens", "50", "--answer-tokens", "4"])
    result = sl.document_scenario(sy, _FakePrompts(), args)
    assert [r["system"] for r in result["rows"]] == [
        "llama-server (cache_prompt, its default)", "ours, full cache, no prefix cache",
        "ours, full cache, --prefix-cache", "ours, full cache, --prefix-cache-dir, restarted after request 1"]
    assert len(started) == 5  # llama, ours plain, ours --prefix-cache, and two for the restart
    first, second = started[3], started[4]
    folder = {argv[argv.index("--prefix-cache-dir") + 1] for argv in (first, second)}
    assert len(folder) == 1  # the same folder
    assert "--prefix-cache" in started[2] and "--prefix-cache-dir" not in started[2]
    # the restarted pair: question 1 to the first process, 2 and 3 to the second
    assert [c for c, _ in asked[-3:]] == ["server4", "server5", "server5"]
    assert [q for _, q in asked[-3:]] == [q.split()[-1] for q in sl.QUESTIONS[:3]]
    assert all(r.get("ratio_median") == pytest.approx(1.0) for r in result["rows"])
    assert "not supported" not in sl.render({"peer": {"document": {**result, "date": "d", "threads": 2,
                                                                      "machine": {"cpu": "x", "cores": 2},
                                                                      "argv": "a"}}})



def _fake_servers(sl, monkeypatch, started: list) -> None:
    """serve_load's servers and clients replaced: each server start is recorded in `started`, every request
    streams one token."""
    import contextlib

    @contextlib.contextmanager
    def fake_server(argv, port, env, log, ready_s=900):
        started.append(argv)
        yield "s"

    monkeypatch.setattr(sl, "server", fake_server)
    monkeypatch.setattr(sl, "openai_client", lambda url: url)
    monkeypatch.setattr(sl, "served_model", lambda client: "m")
    monkeypatch.setattr(sl, "warm_up", lambda client, model: None)
    monkeypatch.setattr(sl, "stream_chat", lambda *a, **k: sl.Sent(sent=0.0, arrivals=[1.0]))

def test_no_llama_runs_ours_only_and_keeps_the_runs_beside_llama_server(sl, tmp_path, monkeypatch):
    started = []

    _fake_servers(sl, monkeypatch, started)
    args = sl.parse_args(["--no-llama", "--questions", "2", "--doc-tokens", "20"])
    assert args.no_llama and not sl.parse_args([]).no_llama
    sy = sl.Systems(bin_dir=None, gguf=None, threads=2, logs=tmp_path, flags={"--prefix-cache", "--prefix-cache-dir"})
    result = sl.document_scenario(sy, _FakePrompts(), args)
    assert len(started) == 4 and not any("llama-server" in " ".join(a) for a in started)
    assert all(r["system"].startswith("ours") for r in result["rows"])
    run = {**result, "date": "d", "threads": 2, "machine": {"cpu": "x", "cores": 2}, "argv": "a"}
    md = sl.render({"peer": {"document": {**run, "rows": [{"system": "llama-server (cache_prompt, its default)",
                                                           **result["rows"][0]} | {"system": "llama-server"}]}},
                    "ours_only": {"document": run}})
    assert "## Beside llama-server" in md and "## Ours alone: chat, document, join (llama-server not run)" in md
    assert md.index("## Beside llama-server") < md.index("## Ours alone")


def test_document_without_the_flags_says_so(sl, tmp_path, monkeypatch):
    _fake_servers(sl, monkeypatch, [])
    sy = sl.Systems(bin_dir=tmp_path, gguf=tmp_path / "m.gguf", threads=2, logs=tmp_path, flags=set())
    result = sl.document_scenario(sy, _FakePrompts(), sl.parse_args(["--questions", "2", "--doc-tokens", "20"]))
    table = "\n".join(sl.document_table(result["rows"]))
    assert table.count("not supported by this build") == 2


def test_targets(sl):
    chat = {"rows": [{"system": "llama-server", "tokens_per_s": 100.0},
                     {"system": "ours, full cache", "tokens_per_s": 120.0},
                     {"system": "ours, InfiniGen", "tokens_per_s": 99.0}], "llama_tokens_per_s": 100.0}
    doc = {"rows": [{"system": "llama-server", "ratio_max": 0.05, "errors": 0},
                    {"system": "ours, a", "ratio_max": 0.09, "errors": 0},
                    {"system": "ours, b", "ratio_max": 0.11, "errors": 0},
                    {"system": "ours, c", "unsupported": "`--prefix-cache`"}]}
    join = {"rows": [{"system": "ours, x", "joined": True, "p99_over_alone_p50": 2.9},
                     {"system": "ours, y", "joined": True, "p99_over_alone_p50": 3.1}]}
    lines = sl.targets({"chat": chat, "document": doc, "join": join})
    assert "- chat, total tokens/s at least llama-server's: ours, full cache met" in lines
    assert "- chat, total tokens/s at least llama-server's: ours, InfiniGen not met" in lines
    text = "\n".join(lines)
    assert "ours, a met" in text and "ours, b not met" in text and "ours, c not supported by this build" in text
    assert "ours, x met" in text and "ours, y not met" in text
    assert "llama-server met" not in text  # only our rows are judged
