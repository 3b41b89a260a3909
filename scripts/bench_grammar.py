"""Grammar libraries side by side: mask time per decode step, schema compile time, coverage.

For each library installed (llguidance, xgrammar, outlines-core) and each
tokenizer (the tiny models' 512-token vocabulary and the 128256-token
``llama3-1b`` preset's), it builds one matcher per row for a typical tool
schema, then walks every row through a valid JSON instance token by token,
timing the masks of all B rows at each step (the work a decode step waits
for). Compile time is schema -> grammar -> one matcher -> its first mask
(llguidance builds its lexer lazily, at the first matcher). Coverage
tries a handful of JSON-Schema features and reports which each library
accepts.

    pip install xgrammar outlines-core   # the rivals; not mlxq dependencies (xgrammar pulls in torch)
    python scripts/bench_grammar.py [--rows 8 64] [--vocab 512 128256]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

TOOL_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "hourly": {"type": "boolean"},
        "fields": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "location": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                     "required": ["lat", "lon"], "additionalProperties": False},
    },
    "required": ["city", "unit", "days", "hourly", "fields", "location"],
    "additionalProperties": False,
}
TOOL_INSTANCE = ('{"city": "Paris", "unit": "celsius", "days": 3, "hourly": false, '
                 '"fields": ["temp", "wind"], "location": {"lat": 48.85, "lon": 2.35}}')

# feature -> (schema, an instance it accepts, one it must refuse). Covered = compiles, accepts, refuses.
COVERAGE = {
    "nested objects": ({"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "integer"}}, "required": ["b"]}}, "required": ["a"]}, {"a": {"b": 1}}, {"a": {"b": "x"}}),
    "arrays": ({"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 3}, [1, 2], [1, 2, 3, 4]),
    "enum": ({"enum": ["red", "green", 3]}, "green", "blue"),
    "const": ({"const": "fixed"}, "fixed", "other"),
    "anyOf": ({"anyOf": [{"type": "string"}, {"type": "integer"}]}, 5, 1.5),
    "oneOf": ({"oneOf": [{"type": "string"}, {"type": "integer"}]}, "x", [1]),
    "$ref": ({"$defs": {"n": {"type": "object", "properties": {"v": {"type": "integer"}, "next": {"$ref": "#/$defs/n"}},
                              "required": ["v"], "additionalProperties": False}}, "$ref": "#/$defs/n"},
             {"v": 1, "next": {"v": 2}}, {"v": 1, "next": {"w": 2}}),
    "pattern": ({"type": "string", "pattern": "^[a-z]{2}-[0-9]{3}$"}, "ab-123", "ab-12"),
    "min/maxLength": ({"type": "string", "minLength": 2, "maxLength": 4}, "abc", "abcde"),
    "minimum/maximum": ({"type": "integer", "minimum": 3, "maximum": 7}, 5, 9),
    "additionalProperties false": ({"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
                                    "additionalProperties": False}, {"x": 1}, {"x": 1, "y": 2}),
    "format date": ({"type": "string", "format": "date"}, "2026-11-30", "30/11/2026"),
    "prefixItems": ({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False},
                    [1, "a"], ["a", 1]),
}


def hf_tokenizer(vocab: int):
    from transformers import AutoTokenizer

    from mlxq.models.tokenizer import write_tokenizer_files

    out = Path(tempfile.mkdtemp(prefix="bench-grammar-"))
    write_tokenizer_files(out, vocab)
    return AutoTokenizer.from_pretrained(str(out))


class Llguidance:
    name = "llguidance"

    def __init__(self, tok, vocab):
        import llguidance
        import llguidance.hf

        self.lib = llguidance
        self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
        self.vocab = vocab
        self.executor = llguidance.LLExecutor()

    def compile(self, schema):
        grammar = self.lib.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        error = self.lib.LLMatcher.validate_grammar(grammar, self.tok)
        if error:
            raise ValueError(error)
        return grammar

    def matchers(self, compiled, rows):
        return [self.lib.LLMatcher(self.tok, compiled) for _ in range(rows)]

    def step(self, matchers, token):
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask_par

        mask = allocate_token_bitmask(len(matchers), self.vocab)
        fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], mask)
        for m in matchers:
            m.consume_token(token)
        return mask


    def accepts(self, compiled, tok, text):
        matcher = self.lib.LLMatcher(self.tok, compiled, log_level=0)
        ok = all(matcher.consume_token(t) for t in tok.encode(text, add_special_tokens=False))
        return ok and matcher.is_accepting()


class LlguidanceSerial(Llguidance):
    """One mask after another on the calling thread: what mlxq's decode loop does per grammar row."""

    name = "llguidance (per row)"

    def step(self, matchers, token):
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

        mask = allocate_token_bitmask(len(matchers), self.vocab)
        for i, m in enumerate(matchers):
            fill_next_token_bitmask(m, mask, i)
        for m in matchers:
            m.consume_token(token)
        return mask


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tok, vocab):
        import xgrammar

        self.lib = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
        self.compiler = xgrammar.GrammarCompiler(info)
        self.batch = xgrammar.BatchGrammarMatcher()
        self.vocab = vocab

    def compile(self, schema):
        return self.compiler.compile_json_schema(json.dumps(schema))

    def matchers(self, compiled, rows):
        return [self.lib.GrammarMatcher(compiled) for _ in range(rows)]

    def step(self, matchers, token):
        mask = self.lib.allocate_token_bitmask(len(matchers), self.vocab)
        self.batch.batch_fill_next_token_bitmask(matchers, mask)
        for m in matchers:
            m.accept_token(token)
        return mask


    def accepts(self, compiled, tok, text):
        matcher = self.lib.GrammarMatcher(compiled)
        ok = all(matcher.accept_token(t) for t in tok.encode(text, add_special_tokens=False))
        return ok and matcher.accept_token(tok.convert_tokens_to_ids("<|im_end|>"))


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tok, vocab):
        import outlines_core

        self.lib = outlines_core
        byte_decoder = {v: k for k, v in _bytes_to_unicode().items()}
        tokens: dict[bytes, list[int]] = {}
        eos = tok.convert_tokens_to_ids("<|im_end|>")
        for token, i in tok.get_vocab().items():
            if i == eos:
                continue
            raw = bytes(byte_decoder[c] for c in token) if all(c in byte_decoder for c in token) else token.encode()
            tokens.setdefault(raw, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(eos, tokens)
        self.vocab = vocab

    def compile(self, schema):
        from outlines_core.json_schema import build_regex_from_schema

        return self.lib.Index(build_regex_from_schema(json.dumps(schema)), self.vocabulary)

    def matchers(self, compiled, rows):
        return [self.lib.Guide(compiled) for _ in range(rows)]

    def step(self, matchers, token):
        mask = np.zeros((len(matchers), (self.vocab + 31) // 32), dtype=np.int32)
        for i, g in enumerate(matchers):
            g.write_mask_into(mask[i].ctypes.data, mask[i].size, 4)
        for g in matchers:
            g.advance(token)
        return mask


    def accepts(self, compiled, tok, text):
        guide = self.lib.Guide(compiled)
        for t in tok.encode(text, add_special_tokens=False):
            if t not in guide.get_tokens():
                return False
            guide.advance(t)
        return guide.is_finished() or self.vocabulary.get_eos_token_id() in guide.get_tokens()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte <-> printable character map (byte-level BPE token spelling)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def measure(lib, tok, rows_list) -> dict:
    # Compile = schema -> grammar -> a matcher -> its first mask (llguidance builds its lexer lazily).
    start = time.perf_counter()
    compiled = lib.compile(TOOL_SCHEMA)
    tokens = tok.encode(TOOL_INSTANCE, add_special_tokens=False)
    lib.step(lib.matchers(compiled, 1), tokens[0])
    result = {"compile_ms": (time.perf_counter() - start) * 1e3}
    for rows in rows_list:
        matchers = lib.matchers(compiled, rows)
        start = time.perf_counter()
        for token in tokens:
            lib.step(matchers, token)
        result[f"mask_ms_B{rows}"] = (time.perf_counter() - start) * 1e3 / len(tokens)
    result["coverage"] = [feature for feature, case in COVERAGE.items() if enforces(lib, tok, *case)]
    return result


def enforces(lib, tok, schema, good, bad) -> bool:
    """Compiles ``schema``, lets ``good`` through to the end and stops ``bad`` somewhere."""
    try:
        compiled = lib.compile(schema)
    except Exception:
        return False
    return lib.accepts(compiled, tok, json.dumps(good)) and not lib.accepts(compiled, tok, json.dumps(bad))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--vocab", type=int, nargs="+", default=[512, 128256])
    args = parser.parse_args()
    head = ["library", "vocab", "compile ms"] + [f"mask ms/step B={b}" for b in args.rows] + ["coverage"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for vocab in args.vocab:
        tok = hf_tokenizer(vocab)
        for cls in (Llguidance, LlguidanceSerial, Xgrammar, OutlinesCore):
            try:
                lib = cls(tok, vocab)
                r = measure(lib, tok, args.rows)
            except ImportError:
                continue
            except Exception as exc:  # a library that cannot handle this tokenizer at all
                print(f"| {cls.name} | {vocab} | failed: {type(exc).__name__}: {str(exc)[:80]} |")
                continue
            cells = [cls.name, str(vocab), f"{r['compile_ms']:.1f}"]
            cells += [f"{r[f'mask_ms_B{b}']:.3f}" for b in args.rows]
            cells.append(f"{len(r['coverage'])}/{len(COVERAGE)}" + (
                "" if len(r["coverage"]) == len(COVERAGE)
                else " (no " + ", ".join(f for f in COVERAGE if f not in r["coverage"]) + ")"))
            print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
