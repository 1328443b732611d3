"""benchmarks/serve_disk.py without a server: the second turn's conversations, the statistics it computes from
recorded timestamps, and its tables."""
from __future__ import annotations


def test_a_follow_up_continues_its_own_conversation(serve_disk):
    chats = [[{"role": "user", "content": "doc 0"}], [{"role": "user", "content": "doc 1"}]]
    out = serve_disk.follow_ups(chats, {0: "answer 0"})  # client 1 had no answer (lost or EOS first)
    assert out[0] == chats[0] + [{"role": "assistant", "content": "answer 0"},
                                 {"role": "user", "content": serve_disk.FOLLOW_UP}]
    assert out[1][1] == {"role": "assistant", "content": ""} and out[1][0] == chats[1][0]
    assert chats[0] == [{"role": "user", "content": "doc 0"}]  # the first turn's prompts are left as they were


def test_decode_rates_leave_out_each_first_token(serve_disk, sl):
    a = sl.Sent(sent=0.0, arrivals=[1.0, 2.0, 3.0], done=3.1, completion_tokens=3)
    b = sl.Sent(sent=0.0, arrivals=[1.5, 2.5], done=2.6, completion_tokens=2)
    s = serve_disk.summary([a, b], wall=3.1, answer_tokens=3)
    assert s["decode_tok_s"] == round(3 / 2.0, 2)  # (2 + 1) tokens after the first ones, from 1.0 to 3.0
    assert s["decode_tok_s_all_running"] == round(2 / 1.0, 2)  # 2.0 and 2.5, between 1.5 and 2.5
    assert s["lost"] == 0 and s["ttft_max_s"] == 1.5


def test_the_decodes_own_rate_is_its_steps_tokens_over_their_seconds(serve_disk, monkeypatch):
    """Over a round: the server's decode counters' growth (what they held before, the warm-up's, left out)."""
    scrapes = iter([{"decode_tokens_total": 10.0, "decode_seconds_total": 2.0},
                    {"decode_tokens_total": 70.0, "decode_seconds_total": 5.0}])
    monkeypatch.setattr(serve_disk, "server_metrics", lambda url, start: next(scrapes))
    monkeypatch.setattr(serve_disk, "concurrent_round", lambda *a: ({}, [], 1.0))
    assert serve_disk.timed_round("url", None, "m", [], 4)[3] == round(60 / 3.0, 2)
    scrapes = iter([{"error": "no /metrics"}, {"error": "no /metrics"}])  # llama-server: not reported
    assert serve_disk.timed_round("url", None, "m", [], 4)[3] is None


def test_the_second_turn_gets_its_own_table(serve_disk):
    turn = {"lost": 0, "requests": 16, "decode_tok_s": 9.5, "decode_tok_s_all_running": 11.0, "tok_s_wall": 8.0,
            "decode_tok_s_in_steps": 30.0,
            "ttft_p50_s": 1.2, "ttft_max_s": 3.4, "equal_alone": 2, "compared_alone": 2, "wall_s": 120.0}
    row = {"system": "InfiniGen (disk, blocks of 16)", "command": "serve ...", "lost": 0, "requests": 16,
           "decode_tok_s": 1.0, "tok_s_wall": 0.9, "ttft_p50_s": 380.0, "ttft_max_s": 700.0, "cgroup_peak_mib": 1536,
           "rss_peak_mib": 1400, "equal_alone": 2, "compared_alone": 2, "wall_s": 800.0, "turn2": turn,
           "prefix_metrics": {"prefix_cache_hit_tokens_total": 128000.0, "prefix_cache_disk_hit_tokens_total": 1e5}}
    d = {"args": {"clients": 16, "doc_tokens": 8000, "answer_tokens": 64, "memory_limit": 1.5 * 2**30,
                  "alone_count": 2, "alone": True}, "rows": [row], "command": "python benchmarks/serve_disk.py",
         "date": "today", "machine": "here", "load_before": "0", "load_after": "0"}
    md = serve_disk.markdown(d)
    first, second = md.split("## The second turn")
    assert "| InfiniGen (disk, blocks of 16) | 0 of 16 | 1.0 |" in first
    assert "| InfiniGen (disk, blocks of 16) | 0 of 16 | 9.5 | 11.0 | 30.0 | 8.0 | 1.2 | 3.4 | 2 of 2 | 120.0 |" \
        in second
    assert "128000.0, 100000.0" in second
    d["rows"] = [{k: v for k, v in row.items() if k != "turn2"}]
    assert "## The second turn" not in serve_disk.markdown(d)  # one turn: one table


def test_a_prefix_folder_that_is_not_there_is_refused_before_the_work(serve_disk, tmp_path, capsys):
    import pytest
    with pytest.raises(SystemExit) as e:
        serve_disk.parse_args(["--prefix-dir", str(tmp_path / "nowhere")])
    assert e.value.code == 2 and "--prefix-dir" in capsys.readouterr().err
    assert serve_disk.parse_args(["--prefix-dir", str(tmp_path)]).prefix_dir == str(tmp_path)


def test_turns_are_one_or_two(serve_disk):
    assert serve_disk.parse_args([]).turns == 1
    assert serve_disk.parse_args(["--turns", "2"]).turns == 2
