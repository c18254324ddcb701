"""Reading a launch script as bash would expand it, without running it: the words of the command that runs
a given Python entry point (Megatron's `pretrain_gpt.py`), and the files the script writes with a heredoc.

What is read: `X=value`, `export X=...` (and `declare` / `local` / `readonly`), `X+=...`; `$X`, `${X}`,
`${X:-default}` / `${X-default}` / `${X:=default}` / `${X:+alt}`, `$((...))` integer arithmetic; single
and double quotes, backslashes, line continuations, comments; arrays `A=( ... )` / `A+=( ... )` over
several lines with comments inside, expanded as `${A[@]}`, `"${A[@]}"`, `${A[*]}`, `${A[i]}`; field
splitting of unquoted expansions (not of quoted ones, and never a second quote removal: an element
`"--split '99,1,0'"` expands, unquoted, to `--split` and `'99,1,0'`, quotes included, as in bash);
`if` / `elif` / `else` with `[ ]`, `[[ ]]` and `test` string and integer comparisons, `-z` / `-n`,
`!`, `&&` / `||`; `eval`; heredocs (`cat <<EOF > file`, expanded unless the delimiter is quoted);
`{ ...; }` and `( ... )` groups; functions, run where they are called.

What is never guessed: a value that only running something gives (a command substitution `$(...)` or
backticks, a variable the script never sets such as `$1` or one the environment provides, a file test,
a loop) stays *unknown*. An unknown piece travels through expansion as a marker, so the caller can
say which argument needs which variable. An `if` whose condition is unknown runs neither branch: the
variables either branch sets become unknown, and a launch line inside it is reported as such. A
`${X:-default}` whose variable is not set takes the script's own default, and the reader records that
it did (`Script.defaults`). Pathname expansion (globbing) is not done: a `*` stays literal.

Why not Python's shlex alone: shlex removes quotes before any expansion could happen, so it cannot
tell `"$A"` (one word) from `$A` (split into words) or `'$A'` (no expansion), and it reads neither `$`
expansions nor arrays, heredocs or `if`. bashlex (a Python port of bash's parser, 0.18) was tried on
the six upstream scripts the tests read (tests/fixtures/upstream/SOURCES.md): it stops at `$((...))` with
NotImplementedError("arithmetic expansion") on five of them, and it parses without expanding. The
tokenizer here is therefore written by hand, for exactly
the subset above; everything else in a script (commands other than the launch line, redirections) is
skipped, not interpreted.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import fnmatch
import operator
import re
from typing import Any

from ..errors import ConfigError

# An unknown piece of a word: MARK + index into Script.unknowns + MARK (no whitespace inside, so it
# survives field splitting as part of its word).
MARK = "\x00"
_MARKED = re.compile(f"{MARK}(\\d+){MARK}")
_NAME = re.compile(r"[A-Za-z_]\w*")
_ASSIGN = re.compile(r"([A-Za-z_]\w*)(\+?)=")
_KEYWORDS_END = {"then", "elif", "else", "fi", "do", "done", "esac", "}"}


@dataclasses.dataclass
class Seg:
    """A piece of a word: literal text, a parameter, arithmetic or a command substitution."""

    kind: str  # lit | param | arith | cmd
    text: str  # literal text, parameter name (with [@] etc.), arithmetic or command text
    quoted: bool
    op: str | None = None  # parameter operator (":-", "-", ":=", "=", ":+", "+", "#")
    arg: str | None = None  # raw text of the operator's word


@dataclasses.dataclass
class Token:
    kind: str  # word | op | array | heredoc
    line: int
    segs: list[Seg] = dataclasses.field(default_factory=list)
    op: str = ""
    name: str = ""  # array: the name
    append: bool = False  # array: +=( )
    elements: list[Token] = dataclasses.field(default_factory=list)  # array: its words
    body: str = ""  # heredoc: the raw body
    expand: bool = True  # heredoc: expanded (unquoted delimiter)

    def literal(self) -> str | None:
        """The word's text when it is one unquoted literal (a keyword, an operator word), else None."""
        if self.kind == "word" and len(self.segs) == 1 and self.segs[0].kind == "lit":
            return None if self.segs[0].quoted else self.segs[0].text
        return None


@dataclasses.dataclass
class Command:
    """A command the script runs (not a shell builtin): its line and its words as bash expands them."""

    line: int
    words: list[str]
    uncertain: str | None = None  # why the script may not reach this line (an unknown condition)

    def entry(self) -> int | None:
        """The index of the Python file the command runs (`torchrun ... pretrain_gpt.py`), if any."""
        return next((j for j, w in enumerate(self.words) if re.fullmatch(r"[^-\s]\S*\.py", w)), None)


@dataclasses.dataclass
class Script:
    """What reading a script found: its launch commands, heredoc files, and what stayed unknown."""

    source: str
    unknowns: list[str] = dataclasses.field(default_factory=list)
    commands: list[Command] = dataclasses.field(default_factory=list)
    files: dict[str, str] = dataclasses.field(default_factory=dict)  # heredoc target -> text
    defaults: list[str] = dataclasses.field(default_factory=list)  # "${3:-MOCK}: MOCK (3 not set)"

    def unknown(self, why: str) -> str:
        self.unknowns.append(why)
        return f"{MARK}{len(self.unknowns) - 1}{MARK}"

    def readable(self, text: str) -> str:
        """An expanded word with each unknown piece shown as the script wrote it ($1, $(cmd ...))."""
        return _MARKED.sub(lambda m: self.unknowns[int(m.group(1))].split(" (")[0], text)

    def unknowns_in(self, text: str) -> list[str]:
        """The descriptions of the unknown pieces in an expanded word, in order."""
        return [self.unknowns[int(i)] for i in _MARKED.findall(text)]


# --------------------------------------------------------------------------- tokenizer


class _Lexer:
    """Bash's words and operators for the subset this module reads (module docstring)."""

    def __init__(self, text: str, source: str):
        self.text, self.source, self.i, self.line = text, source, 0, 1
        self.pending: list[Token] = []  # heredocs whose body starts after the current line

    def error(self, what: str) -> ConfigError:
        return ConfigError(f"{self.source}:{self.line}: cannot read the script: {what}")

    def peek(self, k: int = 0) -> str:
        j = self.i + k
        return self.text[j] if j < len(self.text) else ""

    def tokens(self) -> list[Token]:
        out: list[Token] = []
        while True:
            token = self.next_token()
            if token is None:
                return out
            out.append(token)

    def next_token(self) -> Token | None:
        while True:
            c = self.peek()
            if c in (" ", "\t"):
                self.i += 1
            elif c == "\\" and self.peek(1) == "\n":
                self.i += 2
                self.line += 1
            elif c == "#":
                while self.peek() not in ("\n", ""):
                    self.i += 1
            else:
                break
        c = self.peek()
        if c == "":
            return None
        if c == "\n":
            self.i += 1
            token = Token("op", self.line, op="\n")
            self.line += 1
            self.read_heredoc_bodies()
            return token
        for op in (";;", "&&", "||", "<<-", "<<<", "<<", ">>", "&>", ">&", ";", "&", "|", "(", ")", "<", ">"):
            if self.text.startswith(op, self.i):
                self.i += len(op)
                if op in ("<<", "<<-"):
                    return self.heredoc_start(op)
                return Token("op", self.line, op=op)
        return self.word()

    def word(self, stop: str = " \t\n;&|()<>") -> Token:
        token = Token("word", self.line)
        segs = token.segs
        while (c := self.peek()) != "" and c not in stop:
            if c == "\\":
                nxt = self.peek(1)
                self.i += 2
                if nxt == "\n":
                    self.line += 1
                else:
                    segs.append(Seg("lit", nxt, True))
            elif c == "'":
                end = self.text.find("'", self.i + 1)
                if end < 0:
                    raise self.error("a single quote is not closed")
                body = self.text[self.i + 1 : end]
                self.line += body.count("\n")
                segs.append(Seg("lit", body, True))
                self.i = end + 1
            elif c == '"':
                self.i += 1
                self.double_quoted(segs)
            elif c == "$":
                segs.append(self.dollar(quoted=False))
            elif c == "`":
                segs.append(Seg("cmd", self.backticks(), False))
            else:
                segs.append(Seg("lit", c, False))
                self.i += 1
                if c == "=" and self.peek() == "(" and self.assignment_prefix(segs):
                    return self.array(segs)
        _merge_literals(segs)
        return token

    def assignment_prefix(self, segs: list[Seg]) -> bool:
        text = "".join(s.text for s in segs) if all(s.kind == "lit" and not s.quoted for s in segs) else ""
        return bool(re.fullmatch(r"[A-Za-z_]\w*\+?=", text))

    def array(self, segs: list[Seg]) -> Token:
        head = "".join(s.text for s in segs)
        token = Token("array", self.line, name=head.rstrip("+="), append=head.endswith("+="))
        self.i += 1  # the (
        while True:
            while self.peek() in (" ", "\t", "\n") or (self.peek() == "\\" and self.peek(1) == "\n"):
                if self.peek() == "\\":
                    self.i += 1
                if self.peek() == "\n":
                    self.line += 1
                self.i += 1
            c = self.peek()
            if c == "":
                raise self.error(f"the array {token.name}=( is not closed")
            if c == ")":
                self.i += 1
                return token
            if c == "#":
                while self.peek() not in ("\n", ""):
                    self.i += 1
                continue
            token.elements.append(self.word(stop=" \t\n)"))

    def double_quoted(self, segs: list[Seg], heredoc: bool = False) -> None:
        """Up to the closing quote; heredoc: a heredoc's body, where a quote is an ordinary character."""
        while True:
            c = self.peek()
            if c == "" and heredoc:
                return
            if c == "":
                raise self.error("a double quote is not closed")
            if c == '"' and not heredoc:
                self.i += 1
                segs.append(Seg("lit", "", True))  # "" is an (empty) word
                return
            if c == "\\" and self.peek(1) in ("\\", "$", "`", "\n", "" if heredoc else '"'):
                if self.peek(1) == "\n":
                    self.line += 1
                else:
                    segs.append(Seg("lit", self.peek(1), True))
                self.i += 2
            elif c == "$":
                segs.append(self.dollar(quoted=True))
            elif c == "`":
                segs.append(Seg("cmd", self.backticks(), True))
            else:
                if c == "\n":
                    self.line += 1
                segs.append(Seg("lit", c, True))
                self.i += 1

    def dollar(self, quoted: bool) -> Seg:
        self.i += 1  # the $
        c = self.peek()
        if self.text.startswith("((", self.i):
            return Seg("arith", self.balanced("(", ")")[1:-1], quoted)
        if c == "(":
            return Seg("cmd", self.balanced("(", ")"), quoted)
        if c == "{":
            return self.braced(quoted)
        if c == "'":  # $'...': ANSI-C quoting, read as a single-quoted string
            end = self.text.find("'", self.i + 1)
            body = self.text[self.i + 1 : end]
            self.i = end + 1
            return Seg("lit", body.replace("\\n", "\n").replace("\\t", "\t"), True)
        m = _NAME.match(self.text, self.i)
        if m:
            self.i = m.end()
            return Seg("param", m.group(0), quoted)
        if c and (c.isdigit() or c in "@*#?$!-"):
            self.i += 1
            return Seg("param", c, quoted)
        return Seg("lit", "$", quoted)

    def braced(self, quoted: bool) -> Seg:
        body = self.balanced("{", "}")
        m = re.fullmatch(r"(#?)([A-Za-z_]\w*|\d+|[@*#?])(\[[^\]]*\])?(.*)", body, re.S)
        if m is None:
            return Seg("cmd", "${" + body + "}", quoted)  # unreadable: unknown, named
        length, name, index, rest = m.groups()
        seg = Seg("param", name + (index or ""), quoted)
        if length:
            seg.op = "#"
        elif rest:
            op = next((o for o in (":-", ":=", ":+", "-", "=", "+") if rest.startswith(o)), None)
            if op is None:  # ${X%.*}, ${X//a/b}, ...: an operation this reader does not do
                return Seg("cmd", "${" + body + "}", quoted)
            seg.op, seg.arg = op, rest[len(op) :]
        return seg

    def balanced(self, open_: str, close: str) -> str:
        """The text between the open_ character at self.i and its matching close (quotes skipped)."""
        depth, j = 0, self.i
        while j < len(self.text):
            c = self.text[j]
            if c == open_:
                depth += 1
            elif c == close:
                depth -= 1
                if depth == 0:
                    body = self.text[self.i + 1 : j]
                    self.line += body.count("\n")
                    self.i = j + 1
                    return body
            elif c in "'\"":
                end = self.text.find(c, j + 1)
                j = end if end > 0 else len(self.text)
            j += 1
        raise self.error(f"'{open_}' is not closed")

    def backticks(self) -> str:
        end = self.text.find("`", self.i + 1)
        if end < 0:
            raise self.error("a backtick is not closed")
        body = self.text[self.i + 1 : end]
        self.i = end + 1
        return body

    def heredoc_start(self, op: str) -> Token:
        while self.peek() in (" ", "\t"):
            self.i += 1
        delimiter = self.word()
        raw = "".join(s.text for s in delimiter.segs)
        token = Token("heredoc", self.line, op=raw, expand=not any(s.quoted for s in delimiter.segs))
        token.append = op == "<<-"  # strip leading tabs
        self.pending.append(token)
        return token

    def read_heredoc_bodies(self) -> None:
        for token in self.pending:
            lines = []
            while self.i < len(self.text):
                end = self.text.find("\n", self.i)
                end = len(self.text) if end < 0 else end
                line = self.text[self.i : end]
                self.i = min(end + 1, len(self.text))
                self.line += 1
                if (line.lstrip("\t") if token.append else line) == token.op:
                    break
                lines.append(line.lstrip("\t") if token.append else line)
            token.body = "".join(f"{line}\n" for line in lines)
        self.pending = []


def _merge_literals(segs: list[Seg]) -> None:
    merged: list[Seg] = []
    for s in segs:
        if merged and s.kind == "lit" and merged[-1].kind == "lit" and merged[-1].quoted == s.quoted:
            merged[-1] = Seg("lit", merged[-1].text + s.text, s.quoted)
        else:
            merged.append(s)
    segs[:] = merged


# --------------------------------------------------------------------------- parser


@dataclasses.dataclass
class Simple:
    line: int
    words: list[Token]  # word and array tokens, in order
    redirects: list[tuple[str, Token]] = dataclasses.field(default_factory=list)
    heredocs: list[Token] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class AndOr:
    items: list[tuple[str, Any]]  # ("", first), ("&&" | "||" | "|", next), ...


@dataclasses.dataclass
class If:
    line: int
    branches: list[tuple[list[Any], list[Any]]]  # (condition, body); else: condition []


@dataclasses.dataclass
class Opaque:
    """A loop or a case: its body runs zero or more times, decided only by running the script."""

    line: int
    what: str
    variable: str | None
    body: list[Any]


@dataclasses.dataclass
class Group:
    body: list[Any]


@dataclasses.dataclass
class Function:
    name: str
    body: list[Any]


_SEPARATORS = {"\n", ";", "&"}
_REDIRECTS = {"<", ">", ">>", "&>", ">&", "<<<"}


class _Parser:
    def __init__(self, tokens: list[Token], source: str):
        self.tokens, self.source, self.k = tokens, source, 0

    def peek(self) -> Token | None:
        return self.tokens[self.k] if self.k < len(self.tokens) else None

    def stop_of(self, token: Token, stops: set[str]) -> str | None:
        text = token.op if token.kind == "op" else token.literal()
        return text if text in stops else None

    def parse_list(self, stops: set[str]) -> tuple[list[Any], str | None]:
        nodes: list[Any] = []
        while (token := self.peek()) is not None:
            if token.kind == "op" and token.op in _SEPARATORS:
                self.k += 1
                continue
            if (stop := self.stop_of(token, stops)) is not None:
                self.k += 1
                return nodes, stop
            nodes.append(self.and_or(stops))
        if stops:
            raise ConfigError(
                f"{self.source}: cannot read the script: missing '{' or '.join(sorted(stops))}'"
            )
        return nodes, None

    def and_or(self, stops: set[str]) -> Any:
        items = [("", self.command(stops))]
        while (token := self.peek()) is not None and token.kind == "op" and token.op in ("&&", "||", "|"):
            self.k += 1
            while (t := self.peek()) is not None and t.kind == "op" and t.op == "\n":
                self.k += 1
            items.append((token.op, self.command(stops)))
        return items[0][1] if len(items) == 1 else AndOr(items)

    def command(self, stops: set[str]) -> Any:
        token = self.tokens[self.k]
        word = token.literal()
        if word == "if":
            return self.if_()
        if word in ("for", "while", "until", "select"):
            return self.loop(word)
        if word == "case":
            return self.case()
        if word == "{":
            self.k += 1
            return Group(self.parse_list({"}"})[0])
        if token.kind == "op" and token.op == "(":
            self.k += 1
            return Group(self.parse_list({")"})[0])
        if word == "function" or self.function_ahead():
            return self.function()
        return self.simple(stops)

    def function_ahead(self) -> bool:
        t = self.tokens[self.k : self.k + 3]
        return len(t) == 3 and t[0].literal() is not None and [x.op for x in t[1:]] == ["(", ")"]

    def function(self) -> Function:
        if self.tokens[self.k].literal() == "function":
            self.k += 1
        name = self.tokens[self.k].literal() or ""
        self.k += 1
        if (t := self.peek()) is not None and t.op == "(":
            self.k += 2
        while (t := self.peek()) is not None and t.op == "\n":
            self.k += 1
        return Function(name, [self.command(set())])

    def if_(self) -> If:
        node = If(self.tokens[self.k].line, [])
        self.k += 1
        while True:
            condition, _ = self.parse_list({"then"})
            body, stop = self.parse_list({"elif", "else", "fi"})
            node.branches.append((condition, body))
            if stop == "else":
                body, _ = self.parse_list({"fi"})
                node.branches.append(([], body))
                return node
            if stop == "fi":
                return node

    def loop(self, word: str) -> Opaque:
        line = self.tokens[self.k].line
        self.k += 1
        variable = None
        if word in ("for", "select"):
            variable = self.tokens[self.k].literal()
            while (t := self.peek()) is not None and t.literal() != "do":
                self.k += 1
            self.k += 1
        else:
            self.parse_list({"do"})
        body, _ = self.parse_list({"done"})
        return Opaque(line, f"the {word} loop on line {line}", variable, body)

    def case(self) -> Opaque:
        line = self.tokens[self.k].line
        while (t := self.peek()) is not None and t.literal() != "in":
            self.k += 1
        self.k += 1
        body: list[Any] = []
        while True:
            while (t := self.peek()) is not None and t.kind == "op" and t.op in _SEPARATORS:
                self.k += 1
            if t is None or t.literal() == "esac":
                self.k += 1
                return Opaque(line, f"the case on line {line}", None, body)
            while (t := self.peek()) is not None and not (t.kind == "op" and t.op == ")"):
                self.k += 1  # the pattern
            self.k += 1
            nodes, stop = self.parse_list({";;", "esac"})
            body += nodes
            if stop == "esac":
                return Opaque(line, f"the case on line {line}", None, body)

    def simple(self, stops: set[str]) -> Simple:
        node = Simple(self.tokens[self.k].line, [])
        test = self.tokens[self.k].literal() == "[["
        while (token := self.peek()) is not None:
            if test and token.kind == "op":  # [[ a && b ]]: operators are words of the test
                node.words.append(Token("word", token.line, [Seg("lit", token.op, False)]))
                self.k += 1
                continue
            if token.kind == "op" and token.op in _REDIRECTS:
                self.k += 1
                target = self.peek()
                if target is not None and target.kind == "word":
                    node.redirects.append((token.op, target))
                    self.k += 1
                continue
            if token.kind == "op" or (node.words and self.stop_of(token, stops & _KEYWORDS_END)):
                break
            if token.kind == "heredoc":
                node.heredocs.append(token)
            else:
                node.words.append(token)
            self.k += 1
            if test and token.literal() == "]]":
                test = False
        return node


# --------------------------------------------------------------------------- running (reading) it


class _Exit(Exception):
    pass


class _Runner:
    """Walks the parsed script: assignments, conditions it can decide, launch lines, heredoc files."""

    def __init__(self, script: Script):
        self.script = script
        self.vars: dict[str, str | list[str]] = {}
        self.placeholders: dict[str, str] = {}  # NAME -> the line that looked like NAME=<...>
        self.functions: dict[str, list[Any]] = {}
        self.uncertain: str | None = None  # why the lines being read may not run

    # ---------------------------------------------------------------- statements

    def run(self, nodes: list[Any]) -> None:
        for node in nodes:
            self.node(node)

    def node(self, node: Any) -> bool | None:
        """Run one node; returns its exit status as far as known (True = success, None = unknown)."""
        if isinstance(node, Simple):
            return self.simple(node)
        if isinstance(node, AndOr):
            return self.and_or(node)
        if isinstance(node, If):
            self.if_(node)
        elif isinstance(node, Opaque):
            self.maybe(
                node.body,
                f"inside {node.what}, which runs as many times as the script decides",
                node.variable,
            )
        elif isinstance(node, Group):
            self.run(node.body)
        elif isinstance(node, Function):
            self.functions[node.name] = node.body
        return None

    def and_or(self, node: AndOr) -> bool | None:
        status = self.node(node.items[0][1])
        for op, item in node.items[1:]:
            if op == "|":
                status = self.node(item)
            elif status is None:
                self.maybe([item], "after a command whose success is known only by running it")
            elif status == (op == "&&"):
                status = self.node(item)
        return status

    def if_(self, node: If) -> None:
        for k, (condition, body) in enumerate(node.branches):
            if not condition:  # else
                self.run(body)
                return
            status = self.condition(condition)
            if status is None:
                rest = [n for _, b in node.branches[k:] for n in b]
                self.maybe(
                    rest, f"inside the if on line {node.line}, whose condition needs the script to run"
                )
                return
            if status:
                self.run(body)
                return

    def condition(self, nodes: list[Any]) -> bool | None:
        status: bool | None = True
        for n in nodes:
            status = self.node(n)
        return status

    def maybe(self, nodes: list[Any], why: str, variable: str | None = None) -> None:
        """Lines that may or may not run: read them for launch lines, then make every variable they
        set unknown (it depends on running the script)."""
        before = dict(self.vars)
        outer, self.uncertain = self.uncertain, self.uncertain or why
        if variable:
            self.vars[variable] = self.script.unknown(f"${variable} ({why})")
        try:
            self.run(nodes)
        except _Exit:
            pass
        finally:
            self.uncertain = outer
        changed = {k for k in self.vars if before.get(k) != self.vars[k]}
        self.vars = before
        for name in sorted(changed):
            self.vars[name] = self.script.unknown(f"${name} (set {why})")

    def simple(self, node: Simple) -> bool | None:
        k = 0
        while k < len(node.words) and _assignment(node.words[k]) is not None:
            k += 1
        assignments, command = node.words[:k], node.words[k:]
        if not command:
            for token in assignments:
                self.assign(token)
            return True
        if node.redirects and assignments:  # NAME=<Specify path>: a placeholder bash reads as a redirect
            for token in assignments:
                self.placeholders[_assignment(token) or ""] = f"line {node.line}"
        fields = [f for token in command for f in self.expand(token.segs)]
        if not fields:
            return True
        return self.command(node, command, fields)

    def command(self, node: Simple, words: list[Token], fields: list[str]) -> bool | None:
        name = fields[0]
        if name in ("export", "declare", "typeset", "local", "readonly"):
            for token in words[1:]:
                if _assignment(token) is not None:
                    self.assign(token)
            return True
        if name in ("[", "[[", "test"):
            return self.test(words)
        if name in ("true", ":"):
            return True
        if name == "false":
            return False
        if name == "exit":
            if self.uncertain is None:
                raise _Exit
            return None
        if name == "eval":
            text = " ".join(fields[1:])
            self.run(
                _Parser(_Lexer(text, self.script.source).tokens(), self.script.source).parse_list(set())[0]
            )
            return None
        if name in self.functions:
            self.run(self.functions[name])
            return None
        self.heredoc_files(node)
        if name in ("echo", "printf", "cat", "ls", "cp", "mv", "rm", "mkdir", "cd", "set", "shift"):
            return None
        self.script.commands.append(Command(node.line, fields, self.uncertain))
        return None

    def heredoc_files(self, node: Simple) -> None:
        targets = [t for op, t in node.redirects if op in (">", ">>")]
        if node.heredocs and targets and self.uncertain is None:
            body = node.heredocs[-1]
            text = body.body
            if body.expand:
                segs: list[Seg] = []
                _Lexer(body.body, self.script.source).double_quoted(segs, heredoc=True)
                text = self.join(segs)
            self.script.files[self.join(targets[-1].segs)] = text

    def assign(self, token: Token) -> None:
        if token.kind == "array":
            values = [f for element in token.elements for f in self.expand(element.segs)]
            old = self.vars.get(token.name, [])
            old_list = [old] if isinstance(old, str) else list(old)
            self.vars[token.name] = old_list + values if token.append else values
            return
        head = token.segs[0].text
        m = _ASSIGN.match(head)
        assert m is not None
        rest = [Seg("lit", head[m.end() :], False), *token.segs[1:]]
        value = self.join(rest)
        old = self.vars.get(m.group(1), "")
        if m.group(2):  # +=
            value = (old if isinstance(old, str) else " ".join(old)) + value
        self.vars[m.group(1)] = value
        self.placeholders.pop(m.group(1), None)

    # ---------------------------------------------------------------- expansion

    def join(self, segs: list[Seg]) -> str:
        """A word expanded without field splitting (assignment values, [[ ]] operands, heredocs)."""
        return " ".join(self.expand([dataclasses.replace(s, quoted=True) for s in segs]))

    def expand(self, segs: list[Seg]) -> list[str]:
        """A word's fields, as bash expands it: quoted parts kept whole, unquoted expansions split."""
        fields: list[str] = []
        current: str | None = None
        for seg in segs:
            value = self.value(seg)
            if isinstance(value, list) and seg.quoted:  # "${A[@]}": one field per element
                if not value:
                    continue
                fields.append((current or "") + value[0])
                fields += value[1:-1]
                current = value[-1] if len(value) > 1 else fields.pop()
                continue
            text = " ".join(value) if isinstance(value, list) else value
            if seg.quoted or seg.kind == "lit":
                current = (current or "") + text
                continue
            parts = text.split()
            if not parts:
                if text and current is not None:  # whitespace only: ends the field
                    fields.append(current)
                    current = None
                continue
            if text[0].isspace() and current is not None:
                fields.append(current)
                current = None
            fields.append((current or "") + parts[0])
            fields += parts[1:]
            current = fields.pop()
            if text[-1].isspace():
                fields.append(current)
                current = None
        if current is not None:
            fields.append(current)
        return fields

    def value(self, seg: Seg) -> str | list[str]:
        if seg.kind == "lit":
            return seg.text
        if seg.kind == "cmd":
            what = seg.text if seg.text.startswith("${") else f"$({' '.join(seg.text.split())})"
            return self.script.unknown(f"{what} (a command the script would run)")
        if seg.kind == "arith":
            return self.arithmetic(seg.text)
        return self.parameter(seg)

    def parameter(self, seg: Seg) -> str | list[str]:
        m = re.fullmatch(r"(.+?)(?:\[(.*)\])?", seg.text)
        assert m is not None
        name, index = m.group(1), m.group(2)
        value = self.vars.get(name)
        if value is not None and index is None and isinstance(value, list):
            value = value[0] if value else ""
        elif value is not None and index is not None:
            elements = [value] if isinstance(value, str) else value
            if index in ("@", "*"):
                value = elements if index == "@" else " ".join(elements)
            else:
                i = self.arithmetic(index)
                value = elements[int(i)] if i.lstrip("-").isdigit() and int(i) < len(elements) else None
        is_set = value is not None
        empty = not is_set or value in ("", [])
        if seg.op == "#":
            if not is_set:
                return self.unset(seg.text)
            return str(len(value) if isinstance(value, list) else len(value or ""))
        if seg.op in (":-", "-", ":=", "="):
            if (seg.op.startswith(":") and empty) or not is_set:
                default = self.join(_Lexer(seg.arg or "", self.script.source).word(stop="").segs)
                note = f"${{{seg.text}{seg.op}{seg.arg}}}: {default!r} (${name} not set)"
                if not is_set and note not in self.script.defaults:
                    self.script.defaults.append(note)
                if seg.op.endswith("="):
                    self.vars[name] = default
                return default
            return value if value is not None else ""
        if seg.op in (":+", "+"):
            use = not empty if seg.op == ":+" else is_set
            return self.join(_Lexer(seg.arg or "", self.script.source).word(stop="").segs) if use else ""
        return value if value is not None else self.unset(seg.text)

    def unset(self, name: str) -> str:
        if name.isdigit() or name in ("@", "*", "#"):
            why = "a script argument, given when the script runs"
        elif name in ("$", "!", "?", "-"):
            why = "known only while the script runs"
        elif name in self.placeholders:
            why = f"never set: its assignment on {self.placeholders[name]} is a placeholder to fill in"
        else:
            why = "never set in the script: the environment gives it when the script runs"
        return self.script.unknown(f"${name} ({why})")

    def arithmetic(self, expr: str) -> str:
        text = self.join(_Lexer(expr, self.script.source).word(stop="").segs)
        for _ in range(3):  # bare names are variables, whose values may name others
            text = re.sub(r"[A-Za-z_]\w*", lambda m: str(self.vars.get(m.group(0), "") or 0), text)
        if MARK in text:
            return self.script.unknown(f"$(({expr})) (it needs {', '.join(self.script.unknowns_in(text))})")
        try:
            return str(_integer(ast.parse(text.strip(), mode="eval").body))
        except (SyntaxError, ValueError, ZeroDivisionError):
            return self.script.unknown(f"$(({expr})) (arithmetic this reader does not do)")

    # ---------------------------------------------------------------- tests

    def test(self, words: list[Token]) -> bool | None:
        double = words[0].literal() == "[["
        if double:
            args = [self.join(t.segs) for t in words]
        else:
            args = [f for t in words for f in self.expand(t.segs)]
        if args[0] in ("[", "[[") and args[-1] in ("]", "]]"):
            args = args[1:-1]
        elif args[0] == "test":
            args = args[1:]
        else:
            return None
        try:
            value, rest = _test_or(args)
        except (IndexError, ValueError):
            return None
        return value if not rest else None


_BINARY: dict[type, Any] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: lambda a, b: int(a / b),  # bash: integer division, toward zero
    ast.FloorDiv: lambda a, b: int(a / b),
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}


def _integer(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _integer(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return int(_BINARY[type(node.op)](_integer(node.left), _integer(node.right)))
    raise ValueError("not integer arithmetic")


def _and3(a: bool | None, b: bool | None) -> bool | None:
    return False if a is False or b is False else None if a is None or b is None else True


def _or3(a: bool | None, b: bool | None) -> bool | None:
    return True if a is True or b is True else None if a is None or b is None else False


def _test_or(args: list[str]) -> tuple[bool | None, list[str]]:
    value, rest = _test_and(args)
    while rest and rest[0] in ("||", "-o"):
        other, rest = _test_and(rest[1:])
        value = _or3(value, other)
    return value, rest


def _test_and(args: list[str]) -> tuple[bool | None, list[str]]:
    value, rest = _test_not(args)
    while rest and rest[0] in ("&&", "-a"):
        other, rest = _test_not(rest[1:])
        value = _and3(value, other)
    return value, rest


def _test_not(args: list[str]) -> tuple[bool | None, list[str]]:
    if args[0] == "!":
        value, rest = _test_not(args[1:])
        return (None if value is None else not value), rest
    if args[0] == "(":
        value, rest = _test_or(args[1:])
        return value, rest[1:]
    return _test_primary(args)


_COMPARE = {"-eq": operator.eq, "-ne": operator.ne, "-lt": operator.lt, "-le": operator.le}
_COMPARE |= {"-gt": operator.gt, "-ge": operator.ge}


def _test_primary(args: list[str]) -> tuple[bool | None, list[str]]:
    if len(args) >= 3 and args[1] in ("=", "==", "!=", *_COMPARE):
        left, op, right = args[:3]
        if MARK in left or MARK in right:
            return None, args[3:]
        if op in _COMPARE:
            return _COMPARE[op](int(left), int(right)), args[3:]
        same = fnmatch.fnmatchcase(left, right)
        return (same if op != "!=" else not same), args[3:]
    if args[0] in ("-z", "-n") and len(args) >= 2:
        if MARK in args[1]:
            return None, args[2:]
        return (args[1] == "") == (args[0] == "-z"), args[2:]
    if args[0].startswith("-") and len(args) >= 2:  # file tests and the like: only running tells
        return None, args[2:]
    return (None if MARK in args[0] else args[0] != ""), args[1:]


def _assignment(token: Token) -> str | None:
    """The variable name a word assigns (NAME=..., NAME+=..., NAME=( ... )), else None."""
    if token.kind == "array":
        return token.name
    if token.kind != "word" or not token.segs or token.segs[0].kind != "lit" or token.segs[0].quoted:
        return None
    m = _ASSIGN.match(token.segs[0].text)
    return m.group(1) if m else None


def read_script(text: str, source: str) -> Script:
    """Read a shell script as bash would expand it, without running anything (module docstring)."""
    script = Script(source)
    nodes, _ = _Parser(_Lexer(text, source).tokens(), source).parse_list(set())
    runner = _Runner(script)
    with contextlib.suppress(_Exit):  # an exit the script always reaches ends it
        runner.run(nodes)
    return script
