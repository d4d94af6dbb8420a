"""Plain text out of man pages (roff), GNU info files and HTML; a prose-or-code test.

Used by ``oscar_proxy.corpus``. Deliberately simple and deterministic (pure Python,
no groff): the aim is readable running text for a language model, not a
faithful rendering.
"""

from __future__ import annotations

import html
import re
from html.parser import HTMLParser

_CTRL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def clean_text(text: str) -> str:
    """Normalise newlines, drop control characters and trailing spaces, squeeze blank runs."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _CTRL.sub("", text)
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    return re.sub(r"\n{3,}", "\n\n", text).strip()


_LETTERS = re.compile(r"[^\W\d_]")
_WORD = re.compile(r"[^\W\d_]{2,}")
_CODE_HINT = re.compile(
    r"[{};=<>$\\|#@`]|^\s*(def |class |import |return |if \(|for \(|>>>|\.\.\.|[\"\[\]{}])", re.M
)


def is_prose(para: str) -> bool:
    """A paragraph of running text, not code, tables, hashes or lists of names."""
    chars = "".join(para.split())
    if not chars:
        return False
    letters = len(_LETTERS.findall(chars)) / len(chars)
    words = _WORD.findall(para)
    if letters < 0.6 or len(words) < 4:
        return False
    hints = len(_CODE_HINT.findall(para)) / max(1, len(words))
    return hints < 0.15


# -- man pages (roff: man and mdoc macros) ---------------------------------------------
_NAMED = {
    "aq": "'", "cq": "'", "oq": "'", "lq": '"', "rq": '"', "dq": '"', "em": "\u2014",
    "en": "\u2013", "hy": "-", "mi": "-", "bu": "\u2022", "co": "\u00a9", "rg": "\u00ae",
    "tm": "\u2122", "ti": "~", "ha": "^", "rs": "\\", "sl": "/", ">=": "\u2265",
    "<=": "\u2264", "mu": "\u00d7", "de": "\u00b0", "Aq": "'", "Lq": '"', "Rq": '"',
    "R": "\u00ae", "lh": "", "rh": "", "Tm": "\u2122", "ga": "`", "at": "@", "ba": "|",
    "pl": "+", "eq": "=", "fm": "'", "ua": "^", "da": "v", "->": "->", "<-": "<-",
}  # fmt: skip


def _named(name: str) -> str:
    if name.startswith("u") and len(name) == 5 and all(c in "0123456789ABCDEF" for c in name[1:]):
        return chr(int(name[1:], 16))
    return _NAMED.get(name, "")


_ESC = re.compile(
    r"\\\((..)"  # \(xx
    r"|\\\[([^\]]*)\]"  # \[name]
    r"|\\\*(?:\((..)|\[([^\]]*)\]|(.))"  # strings \*(xx \*[name] \*x
    r"|\\f(?:\(..|\[[^\]]*\]|.)"  # fonts
    r"|\\s[+-]?(?:\d|\(\d\d|\[\d+\])"  # size
    r"|\\[nFgkmMV](?:\(..|\[[^\]]*\]|.)"  # registers etc.
    r"|\\[hvwoblLDXZNRSxY]'[^']*'"  # quoted-argument escapes
    r"|\\(.)"  # anything else
)
_SIMPLE = {"-": "-", "e": "\\", "\\": "\\", " ": " ", "~": " ", "0": " ", "'": "'", "`": "`",
           ".": ".", "t": "\t"}  # fmt: skip


def _esc(m: re.Match) -> str:
    two, long, s2, slong, s1, other = m.group(1, 2, 3, 4, 5, 6)
    if two is not None:
        return _named(two)
    if long is not None:
        return _named(long)
    if s2 is not None or slong is not None or s1 is not None:
        return _named(s2 or slong or s1)
    if other is not None:
        return _SIMPLE.get(other, "")
    return ""


def _unescape(s: str) -> str:
    s = re.sub(r'\\".*', "", s)
    return _ESC.sub(_esc, s)


_HEAD = {"SH", "SS", "Sh", "Ss"}
_PARA = {"PP", "LP", "P", "TP", "IP", "HP", "sp", "Pp", "Bl", "El", "RS", "RE", "br", "Dl", "Bd",
         "Ed", "TQ", "EX", "EE", "in", "ti"}  # fmt: skip
_ALT = {"BR", "RB", "IR", "RI", "BI", "IB"}
_TEXT = {"B", "I", "SM", "SB", "Nm", "Ar", "Pa", "Cm", "Ic", "Em", "Dq", "Ql", "Sy", "Xr", "Nd",
         "It", "Op", "Fl", "Va", "Ev", "Er", "Fn", "Fa", "Ft", "Li", "Ad", "Lk", "Mt", "An",
         "Dv", "Sq", "Pq", "Qq", "Aq", "Bq", "No", "Ns", "Tn", "St", "Ux", "At", "Bx", "UR",
         "MT", "Vt", "Cd", "Sx", "Lb", "Ms", "Oo", "Oc", "Po", "Pc"}  # fmt: skip


def _args(s: str) -> list[str]:
    return [a[1:-1] if a.startswith('"') and a.endswith('"') and len(a) > 1 else a
            for a in re.findall(r'"[^"]*"|\S+', s)]  # fmt: skip


def _mdoc_words(name: str, args: list[str]) -> list[str]:
    """Arguments of an mdoc line with nested macro names removed (``Fl`` adds a dash)."""
    words, dash = [], name == "Fl"
    for a in args:
        if a in _TEXT or a in ("Ns", "Oo", "Oc", "Ta"):
            dash = a == "Fl"
        else:
            words.append("-" + a if dash else a)
    return words


def man_to_text(src: str) -> str:
    """Running text of a man page: headings, paragraphs, fonts and escapes stripped."""
    out: list[str] = []
    para: list[str] = []
    nofill = skip = False
    nm = ""

    def flush():
        if para:
            out.append(("\n" if nofill else " ").join(para))
            para.clear()

    for raw in src.split("\n"):
        line = raw.rstrip()
        if skip:
            if line.startswith((".TE", "..")):
                skip = False
            continue
        if line.startswith((".", "'")):
            m = re.match(r"[.']\s*(\S*)\s*(.*)", line)
            name, rest = (m.group(1), m.group(2)) if m else ("", "")
            if name in ("TS", "de", "ig", "am"):
                skip = True
            elif name in _HEAD:
                flush()
                out.append(_unescape(" ".join(_args(rest))).upper() if name == "SH" else
                           _unescape(" ".join(_args(rest))))  # fmt: skip
            elif name in _PARA:
                flush()
            elif name == "nf":
                flush()
                nofill = True
            elif name == "fi":
                flush()
                nofill = False
            elif name in _ALT:
                para.append(_unescape("".join(_args(rest))))
            elif name in _TEXT:
                words = _mdoc_words(name, _args(rest))
                if name == "Nm":
                    nm = nm or " ".join(words)
                    words = words or [nm]
                para.append(_unescape(" ".join(words)))
            continue
        text = _unescape(line)
        if text.strip() or nofill:
            para.append(text)
        elif not nofill:
            flush()
    flush()
    text = "\n\n".join(p.strip("\n") for p in out if p.strip())
    return re.sub(r"[ \t]{2,}", " ", text) if "\t" in text else text


# -- Perl POD and Python docstrings ------------------------------------------------------
_POD_CODE = re.compile(r"[BICFSLEXZ]<(?:<+\s)?([^<>]*?)(?:\s>+)?>")


def pod_to_text(src: str) -> str:
    """The POD documentation of a Perl file (commands turned into headings / items)."""
    out, inside = [], False
    for block in re.split(r"\n\s*\n", src):
        first = block.lstrip("\n")
        if first.startswith("=cut"):
            inside = False
            continue
        if first.startswith("="):
            inside = True
            cmd, _, rest = first[1:].partition(" ")
            if cmd.startswith(("head", "item")) and rest.strip() not in ("", "*"):
                out.append(rest.strip())
            continue
        if inside:
            out.append(block)
    text = "\n\n".join(out)
    for _ in range(3):  # nested formatting codes
        text = _POD_CODE.sub(lambda m: m.group(1).split("|")[0], text)
    return text


def docstrings_text(src: str) -> str:
    """Module, class and function docstrings of a Python file, each under its dotted name."""
    import ast

    tree = ast.parse(src)
    out = []

    def visit(node, prefix: str):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                name = prefix + child.name
                doc = ast.get_docstring(child)
                if doc and not child.name.startswith("_"):
                    out.append(f"{name}\n\n{doc}")
                visit(child, name + ".")

    doc = ast.get_docstring(tree)
    if doc:
        out.append(doc)
    visit(tree, "")
    return "\n\n".join(out)


# -- GNU info --------------------------------------------------------------------------
def info_nodes(text: str, min_chars: int = 4000) -> list[str]:
    """The nodes of an info file, without headers, menus and tag tables; short nodes merged."""
    docs, cur = [], []
    for chunk in text.split("\x1f"):
        chunk = chunk.lstrip("\n")
        if not chunk.startswith("File:"):
            continue
        body = chunk.split("\n", 1)[1] if "\n" in chunk else ""
        body = body.split("\n* Menu:", 1)[0]
        cur.append(body.strip())
        if sum(len(c) for c in cur) >= min_chars:
            docs.append("\n\n".join(cur))
            cur = []
    if cur:
        docs.append("\n\n".join(cur))
    return docs


# -- HTML -------------------------------------------------------------------------------
class _Text(HTMLParser):
    _BLOCK = {"p", "div", "br", "li", "h1", "h2", "h3", "h4", "h5", "h6", "pre", "tr", "dt",
              "dd", "table", "ul", "ol", "blockquote", "hr", "section"}  # fmt: skip

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.hidden = 0

    def handle_starttag(self, tag, attrs):
        if tag in ("script", "style", "head"):
            self.hidden += 1
        elif tag in self._BLOCK:
            self.parts.append("\n\n")

    def handle_endtag(self, tag):
        if tag in ("script", "style", "head"):
            self.hidden = max(0, self.hidden - 1)
        elif tag in self._BLOCK:
            self.parts.append("\n\n")

    def handle_data(self, data):
        if not self.hidden:
            self.parts.append(re.sub(r"[ \t\n]+", " ", data))


def html_to_text(src: str) -> str:
    p = _Text()
    try:
        p.feed(src)
        p.close()
    except (AssertionError, ValueError):
        return html.unescape(re.sub(r"<[^>]+>", " ", src))
    text = "".join(p.parts)
    return "\n\n".join(s.strip() for s in re.split(r"\n\s*\n", text) if s.strip())
