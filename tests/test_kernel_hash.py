"""The kernel hash names the code that decides the compiled kernel: comments, docstrings and blank
lines may change without making tuned tables stale; any code change makes them stale."""

from __future__ import annotations

import shutil

import pytest

from fa4tune.kernels import code_text, family, get_kernel

SOURCE = '''"""Module docstring."""
import math  # a comment

SCALE = 2.0


class Tile:
    """Class docstring,
    over two lines."""

    size = 128  # µ-comment with non-ASCII

    def area(self, n):
        """Method docstring."""
        # a whole-line comment

        return self.size * n


def label(name="µ"): "a docstring after non-ASCII on its line"; return f"#{name}"
'''


def test_code_text_drops_comments_docstrings_and_blank_lines_only():
    text = code_text(SOURCE)
    assert text.splitlines() == [
        "import math",
        "SCALE = 2.0",
        "class Tile:",
        "    size = 128",
        "    def area(self, n):",
        "        return self.size * n",
        'def label(name="µ"): ; return f"#{name}"',
    ]


@pytest.mark.parametrize(
    "old,new",
    [
        ('"""Module docstring."""', '"""Another module docstring,\n\nlonger."""'),
        ("# a comment", "# another comment"),
        ('"""Method docstring."""', "'Method docstring, reworded.'"),
        ("        # a whole-line comment\n", ""),
        ("\n\nclass Tile", "\n\n\n\nclass Tile"),
        ("return self.size * n", "return self.size * n   "),
    ],
)
def test_edits_that_cannot_change_the_code_keep_its_text(old, new):
    assert old in SOURCE
    assert code_text(SOURCE.replace(old, new)) == code_text(SOURCE)


@pytest.mark.parametrize(
    "old,new",
    [
        ("SCALE = 2.0", "SCALE = 2.5"),
        ("size = 128", "size = 192"),
        ('f"#{name}"', 'f"# {name}"'),  # a '#' inside a string is not a comment
        ("return self.size * n", "return n * self.size"),
        ("    size = 128", "    size = 128\n    'not a docstring: second statement'"),
    ],
)
def test_code_edits_change_its_text(old, new):
    assert old in SOURCE
    assert code_text(SOURCE.replace(old, new)) != code_text(SOURCE)


def test_line_separators_other_than_newline_do_not_shift_the_cuts():
    # str.splitlines would also split on \u2028, \x0c, \x85, ...: every later cut would then land
    # one line early, cutting code and keeping the docstring.
    for separator in ("\u2028", "\x0c", "\x85"):
        source = f"# note{separator}x\ndef f():\n    'doc'\n    return 1\n"
        assert code_text(source) == "def f():\n    return 1"
        assert code_text(source.replace("def f", "def g")) != code_text(source)


def test_code_after_a_docstring_on_its_closing_line_counts():
    source = 'def f():\n    """a\n    b"""; x = 1\n    return x\n'
    assert code_text(source) == "def f():\n; x = 1\n    return x"
    assert code_text(source.replace("x = 1", "x = 2")) != code_text(source)


@pytest.mark.parametrize(
    "old,new",
    [
        ('ASM = """\nmov.b32 %r0, 1;\n\nret;\n"""', 'ASM = """\nmov.b32 %r0, 1;\nret;\n"""'),
        ('ASM = """\nmov.b32 %r0, 1;\n\nret;\n"""', 'ASM = """\nmov.b32 %r0, 1;  \n\nret;\n"""'),
        ('ASM = f"""\n{X}\n\n"""', 'ASM = f"""\n{X}\n"""'),
    ],
)
def test_blank_lines_and_trailing_spaces_inside_code_strings_count(old, new):
    assert code_text(old) != code_text(new)


def test_source_that_does_not_parse_is_taken_whole():
    broken = "def f(:\n    # comment\n    return 1\n"
    assert code_text(broken) == broken
    with_nul = "x = 1  # \0\n"
    assert code_text(with_nul) == with_nul  # ast.parse raises ValueError on 3.10-3.11


@pytest.fixture
def kernel_copy(tmp_path, monkeypatch):
    """A fresh instance of the installed kernel family reading a copy of the kernels' sources."""
    copy = tmp_path / "kernels"
    shutil.copytree(family.KERNELS_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(family, "KERNELS_DIR", copy)
    installed = get_kernel()

    def fresh_hash() -> str:
        return type(installed)().source_hash()

    return copy, fresh_hash, installed.source_hash()


def test_kernel_hash_survives_doc_edits_and_not_code_edits(kernel_copy):
    copy, fresh_hash, installed = kernel_copy
    assert fresh_hash() == installed
    kernel = copy / "fa4_fwd_sm90" / "kernel.py"
    source = kernel.read_text(encoding="utf-8")
    first_docstring_line = source.split('"""', 2)[1].splitlines()[0]
    kernel.write_text(
        source.replace(first_docstring_line, "Reworded.", 1) + "\n# a note\n", encoding="utf-8"
    )
    assert fresh_hash() == installed
    kernel.write_text(
        source.replace("BARRIER_EPILOGUE = 1", "BARRIER_EPILOGUE = 3", 1), encoding="utf-8"
    )
    assert "BARRIER_EPILOGUE = 1" in source and fresh_hash() != installed
    kernel.write_text(source, encoding="utf-8")
    assert fresh_hash() == installed
    (copy / "fa4_fwd_sm90" / "extra_helpers.py").write_text("X = 1\n", encoding="utf-8")
    assert fresh_hash() != installed  # a new kernel file counts too


def test_kernel_hash_covers_the_shared_code_and_not_the_cost_model(kernel_copy):
    copy, fresh_hash, installed = kernel_copy
    for name in ("fa4_fwd_sm90/cost_model.py", "fa4_fwd_sm90/peers.py", "common/reference.py"):
        (copy / name).write_text((copy / name).read_text() + "\nEXTRA = 1\n")
    assert fresh_hash() == installed  # what does not compile or launch
    softmax = copy / "sm90" / "softmax.py"
    softmax.write_text(softmax.read_text() + "\nEXTRA = 1\n")
    assert fresh_hash() != installed  # the shared device code compiles into the kernel
