"""A request's answer as the server sends it: each token's bytes and text (`Pieces`), the text cut at stop
strings and held back where a stop string or a character may still be forming (`AnswerText`), and the
log-probabilities of what was shown (`Answer`)."""
from __future__ import annotations

import codecs
import re

from .engine import Request


class Pieces:
    """Each token's own bytes (a byte-level BPE token is a byte sequence; a SentencePiece one a piece or a
    <0xNN> byte) and its text as OpenAI shows it: "bytes:\\xe2\\x80" for a piece of a character."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        decoder = repr(getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None))
        self.bytes_of_char = None
        if "ByteLevel" in decoder:
            from transformers.convert_slow_tokenizer import bytes_to_unicode
            self.bytes_of_char = {c: b for b, c in bytes_to_unicode().items()}
        self.metaspace = "Metaspace" in decoder or "▁" in decoder
        self.added = {i: t.content for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()}
        self._bytes: dict[int, bytes] = {}

    def bytes(self, token: int) -> bytes:
        b = self._bytes.get(token)
        if b is None:
            b = self._bytes[token] = self._find_bytes(token)
        return b

    def _find_bytes(self, token: int) -> bytes:
        if token in self.added:
            return self.added[token].encode("utf-8")
        piece = self.tok.convert_ids_to_tokens(token)
        if not isinstance(piece, str):
            return self.tok.decode([token]).encode("utf-8")
        if self.bytes_of_char is not None and all(c in self.bytes_of_char for c in piece):
            return bytes(self.bytes_of_char[c] for c in piece)
        m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
        if m:
            return bytes([int(m.group(1), 16)])
        if self.metaspace:
            return piece.replace("▁", " ").encode("utf-8")
        return self.tok.decode([token]).encode("utf-8")

    def text(self, token: int) -> str:
        b = self.bytes(token)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{x:02x}" for x in b)

    def offsets(self, tokens: list[int]) -> list[int]:
        """Character offset of each token in the text the tokens spell (a character split over tokens counts
        at the token that completes it)."""
        dec, n, out = codecs.getincrementaldecoder("utf-8")("replace"), 0, []
        for t in tokens:
            out.append(n)
            n += len(dec.decode(self.bytes(t)))
        return out


class Answer:
    """A request's answer as it is sent: its text (`AnswerText`) and the log-probabilities of the tokens whose
    text has been sent (a token is in once its text starts before what was shown; the tokens of a stop
    string and the tokens after it never are)."""

    def __init__(self, req: Request, tokenizer, pieces: Pieces, stop: list[str], chat: bool, echo: str | None):
        self.req, self.pieces, self.chat, self.echo = req, pieces, chat, echo
        self.text = AnswerText(tokenizer, stop)
        self.echoed = False
        self.sent = 0  # tokens whose log-probabilities went out

    def reason(self) -> str:
        return "stop" if self.text.stopped or self.req.finish == "stop" else "length"

    def logprobs(self, shown: int, prompt: bool = False) -> dict | None:
        """The log-probabilities not sent yet of the tokens whose text starts before character `shown` of the
        answer (and, with `prompt`, of the echoed prompt's tokens first); None when the request asked for none."""
        req = self.req
        if req.logprobs is None:
            return None
        t = self.text
        end = self.sent
        while end < len(t.starts) and end < len(req.token_logprobs) and t.starts[end] < shown:
            end += 1
        ids, entries = t.ids[self.sent:end], req.token_logprobs[self.sent:end]
        base = len(self.echo) if self.echo is not None else 0
        offsets = [base + x for x in t.starts[self.sent:end]]
        self.sent = end
        if prompt and req.prompt_token_logprobs is not None:
            ids, entries = req.prompt + ids, req.prompt_token_logprobs + entries
            offsets = self.pieces.offsets(req.prompt) + offsets
        p = self.pieces
        if self.chat:
            def alt(tok, lp):
                return {"token": p.text(tok), "logprob": lp, "bytes": list(p.bytes(tok))}
            return {"content": [{**alt(tok, lp), "top_logprobs": [alt(a, v) for a, v in top]}
                                for tok, (lp, top) in zip(ids, entries)], "refusal": None}
        out = {"tokens": [p.text(tok) for tok in ids], "token_logprobs": [], "top_logprobs": [], "text_offset": offsets}
        for tok, e in zip(ids, entries):
            if e is None:  # the first prompt token: nothing before it predicts it
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            lp, top = e
            alts = {p.text(a): v for a, v in top}
            alts.setdefault(p.text(tok), lp)  # OpenAI: the top `logprobs`, and the sampled token always
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append(alts)
        return out

    @staticmethod
    def has_entries(lp: dict | None) -> bool:
        return bool(lp) and bool(lp.get("content") or lp.get("tokens"))


class AnswerText:
    """A request's text as tokens arrive: decoded whole (multi-token characters come out right), cut at
    the first stop string; `take` hands out what is safe to show (a possible start of a stop string and
    an incomplete character are held back). `starts[i]`: where token i's text begins."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tok, self.stop, self.ids, self.starts = tokenizer, stop, [], []
        self.text, self.shown, self.stopped = "", 0, False
        self.hold = max((len(s) for s in stop), default=1) - 1

    def add(self, token: int) -> bool:
        """Add a token; True once a stop string appeared (the text then ends before it)."""
        if self.stopped:
            return True
        self.starts.append(len(self.text.rstrip("\ufffd")))
        self.ids.append(token)
        self.text = self.tok.decode(self.ids, skip_special_tokens=True)
        cut = [i for i in (self.text.find(s) for s in self.stop) if i >= 0]
        if cut:
            self.text, self.stopped = self.text[:min(cut)], True
        return self.stopped

    def take(self) -> str:
        end = len(self.text) if self.stopped else len(self.text) - self.hold
        if not self.stopped:
            end = min(end, len(self.text.rstrip("\ufffd")))  # an incomplete character waits for its bytes
        if end <= self.shown:
            return ""
        out, self.shown = self.text[self.shown:end], end
        return out

    def finish(self) -> str:
        """Everything not shown yet (the whole text of a non-streamed answer)."""
        out, self.shown = self.text[self.shown:], len(self.text)
        return out
