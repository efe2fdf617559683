"""What makes a tuned table stale: the hash of the code that decides a compiled kernel. Comments,
docstrings, blank lines and trailing spaces do not count, so editing them leaves tables valid."""

from __future__ import annotations

import ast
import hashlib
import io
import tokenize
from pathlib import Path

# Names what hash_files covers; a new scheme gives every kernel a new hash (and stale tables).
# Scheme 2: files are named by their path below fa4tune/kernels/ (scheme 1: their name alone).
CODE_HASH_SCHEME = b"code-text-2"


def hash_files(files: list[Path], root: Path) -> str:
    """sha256 over the files' paths below `root` and their code_text."""
    digest = hashlib.sha256(CODE_HASH_SCHEME + b"\0")
    for path in sorted(files):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(code_text(path.read_text(encoding="utf-8")).encode())
        digest.update(b"\0")
    return digest.hexdigest()


def code_text(source: str) -> str:
    """Python source without its comments, docstrings, blank lines and trailing spaces: what is left
    can change the compiled kernel, what is cut cannot, so editing it leaves tuned tables valid.
    Blank lines and trailing spaces inside other string literals are kept (they are data). The cuts
    come from token and node positions, on which Python versions agree (an AST dump does not: 3.12
    added fields). Source that does not parse is taken whole."""
    source = source.replace("\r\n", "\n").replace("\r", "\n")
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
        tree = ast.parse(source)
    except (SyntaxError, ValueError, tokenize.TokenError):
        return source
    # Rows as tokenize and ast count them: split on "\n" only
    # (splitlines also splits on \f, \x85, ...).
    lines = source.split("\n")

    def column(row: int, byte: int) -> int:  # the AST counts columns in UTF-8 bytes
        return len(lines[row - 1].encode()[:byte].decode(errors="ignore"))

    docstrings = []
    for node in ast.walk(tree):
        if (
            isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body
        ):
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                docstrings.append(
                    (
                        (first.lineno, column(first.lineno, first.col_offset)),
                        (first.end_lineno, column(first.end_lineno, first.end_col_offset)),
                    )
                )
    # Rows that end inside a string literal other than a docstring keep their trailing spaces, and
    # rows wholly inside one are kept even when blank. (3.12 splits f-strings into several tokens.)
    ends_in_string, inside_string, fstring_starts = set(), set(), []
    fstring_start, fstring_end = (
        getattr(tokenize, "FSTRING_START", None),
        getattr(tokenize, "FSTRING_END", None),
    )
    for tok in tokens:
        if tok.type == fstring_start:
            fstring_starts.append(tok.start)
            continue
        if tok.type == fstring_end:
            start = fstring_starts.pop()
        elif tok.type == tokenize.STRING:
            start = tok.start
        else:
            continue
        if tok.end[0] > start[0] and not any(a <= start < b for a, b in docstrings):
            ends_in_string.update(range(start[0], tok.end[0]))
            inside_string.update(range(start[0] + 1, tok.end[0]))
    spans = docstrings + [(tok.start, tok.end) for tok in tokens if tok.type == tokenize.COMMENT]
    for (row, col), (end_row, end_col) in sorted(spans, reverse=True):  # later cuts first
        if row == end_row:
            lines[row - 1] = lines[row - 1][:col] + lines[row - 1][end_col:]
        else:
            lines[row - 1 : end_row] = (
                [lines[row - 1][:col]] + [""] * (end_row - row - 1) + [lines[end_row - 1][end_col:]]
            )
    kept = []
    for row, line in enumerate(lines, 1):
        if row in inside_string or row in ends_in_string:
            kept.append(line)
        elif line.strip():
            kept.append(line.rstrip())
    return "\n".join(kept)
