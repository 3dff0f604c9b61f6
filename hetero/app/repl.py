"""The `hetero chat` conversation loop (Ollama / llama-cli habits), independent of typer.

Interactive: `>>> ` prompt with line editing and a history kept in the cache folder, `... `
continuation, `\"\"\"` opens and closes multi-line input, slash commands, Ctrl+C stops an answer,
Ctrl+D exits, a dim stats line after each answer. Piped: the same input rules (slash commands,
`\"\"\"` blocks), each other line is one user message, and only the answers reach stdout.
"""
from __future__ import annotations

import sys
from typing import Callable, TextIO

from rich.console import Console

from hetero.context import ContextFull, Overflow
from hetero.app.engine import Engine
from hetero.errors import UserError
from hetero.paths import cache_dir
from hetero.sampling import RANGES, parse_param

HELP = """Commands:
  /set system TEXT            set the system message (starts a new conversation)
  /set parameter NAME VALUE   temperature, top_k, top_p, min_p, repeat_penalty, seed, max_new_tokens
  /set context-overflow MODE  drop-turns, shift or stop
  /show info|plan|template|parameters
  /clear                      start a new conversation
  /regen                      answer the last message again
  /bye, /exit                 leave (Ctrl+D too)
  /?                          this help
Use \"\"\" to begin and end a multi-line message. Ctrl+C stops an answer."""

class ChatSession:
    def __init__(self, engine: Engine, out: TextIO, console: Console, system: str | None = None, **params):
        self.engine, self.out, self.console = engine, out, console
        self.system, self.params = system, params
        self.messages: list[dict] = []

    def _history(self) -> list[dict]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.messages

    def answer(self, text: str, show_stats: bool) -> None:
        """Answer one message. A conversation that cannot go on (stop mode, one message longer than
        the context) raises ContextFull; interactively the message is then forgotten and the chat goes on."""
        self.messages.append({"role": "user", "content": text})
        try:
            self._reply(show_stats)
        except ContextFull as e:
            self.messages.pop()
            if not show_stats:
                raise
            self.console.print(f"[red]{e}[/red]", highlight=False)

    def _reply(self, show_stats: bool) -> None:
        pieces = []
        try:
            for chunk in self.engine.chat(self._history(), **self.params):
                pieces.append(chunk.text)
                self.out.write(chunk.text)
                self.out.flush()
        except KeyboardInterrupt:  # stop this answer, keep the conversation
            self.out.write("\n")
            self.console.print("[dim](stopped)[/dim]")
        self.out.write("\n")
        self.out.flush()
        self.messages.append({"role": "assistant", "content": "".join(pieces)})
        for note in self.engine.last_stats.notes:
            self.console.print(f"[dim]({note})[/dim]", highlight=False)
        if show_stats:
            self.console.print(f"[dim]{self.engine.last_stats.line()}[/dim]")

    def command(self, line: str) -> bool:
        """Handle a slash command; False means leave."""
        parts = line.split(maxsplit=3)
        cmd = parts[0]
        if cmd in ("/bye", "/exit"):
            return False
        if cmd == "/?" or cmd == "/help":
            self.console.print(HELP)
        elif cmd == "/clear":
            self.messages.clear()
            self.engine.reset_chat()
            self.console.print("Cleared session context")
        elif cmd == "/regen":
            if self.messages and self.messages[-1]["role"] == "assistant":
                self.messages.pop()
                self._reply(show_stats=True)
            else:
                self.console.print("nothing to regenerate yet")
        elif cmd == "/set" and len(parts) >= 3 and parts[1] == "system":
            self.system = line.split(maxsplit=2)[2]
            self.messages.clear()
            self.console.print("Set system message.")
        elif cmd == "/set" and len(parts) == 4 and parts[1] == "parameter":
            name, value = parts[2], parts[3]
            try:
                self.params[name] = parse_param(name, value)
            except UserError as e:
                self.console.print(f"[red]{e}[/red]", highlight=False)
            else:
                self.console.print(f"Set parameter '{name}' to '{value}'")
        elif cmd == "/set" and len(parts) == 3 and parts[1] == "context-overflow":
            try:
                self.engine.overflow = Overflow.parse(parts[2])
            except UserError as e:
                self.console.print(f"[red]{e}[/red]", highlight=False)
            else:
                self.console.print(f"Set context-overflow to '{parts[2]}'")
        elif cmd == "/set":
            self.console.print(f"usage: /set system TEXT | /set parameter NAME VALUE ({', '.join(RANGES)}) | "
                               f"/set context-overflow drop-turns|shift|stop", highlight=False)
        elif cmd == "/show" and len(parts) >= 2:
            what = parts[1]
            if what == "info":
                for k, v in self.engine.info.items():
                    self.console.print(f"  {k:12} {v}")
            elif what == "plan":
                from planner.report import render

                render(self.engine.plan, self.console, None)
            elif what == "template":
                self.console.print(self.engine.tok.chat_template if self.engine.tok else "(none)", markup=False)
            elif what == "parameters":
                self.console.print(str(self.engine.defaults.update(**self.params)))
            else:
                self.console.print("usage: /show info|plan|template|parameters")
        else:
            self.console.print(f"Unknown command '{line}'. Type /? for help")
        return True


def run_chat(session: ChatSession, stdin: TextIO, interactive: bool, read: Callable[[str], str] | None = None) -> None:
    """The loop: the same input rules whether a person types or a script pipes; `read(prompt)`
    raises EOFError at the end (Ctrl+D)."""
    if read is None:
        read = line_editor(session.console) if interactive else _lines(stdin)
    if interactive:
        session.console.print("[dim]Send a message (/? for help)[/dim]")
        session.engine.load_kernels()  # while the user types (the first answer waits for them)
    while True:
        try:
            line = read(">>> ")
        except EOFError:
            if interactive:
                session.out.write("\n")
            return
        except KeyboardInterrupt:
            session.out.write("\n")
            continue
        if line.strip().startswith('"""'):
            line = _multiline(line.strip()[3:], read)
            if line is None:
                continue
        elif line.startswith("/"):
            if not session.command(line.strip()):
                return
            continue
        if line.strip():
            session.answer(line, show_stats=interactive)


def _lines(stdin: TextIO) -> Callable[[str], str]:
    def read(prompt: str) -> str:
        line = stdin.readline()
        if not line:
            raise EOFError
        return line.rstrip("\n")

    return read


def line_editor(console: Console) -> Callable[[str], str]:
    """Line editing and history (Up arrow) by prompt_toolkit, the history kept in the cache folder;
    in memory only when that folder cannot be written."""
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import FileHistory, InMemoryHistory

    path = cache_dir() / "chat_history"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a"):
            pass
        history = FileHistory(str(path))
    except OSError as e:
        console.print(f"[dim](history is not kept: cannot write {path}: {e.strerror})[/dim]", highlight=False)
        history = InMemoryHistory()
    prompt = PromptSession(history=history)
    return lambda text: prompt.prompt(text)


def _multiline(first: str, read: Callable[[str], str]) -> str | None:
    if first.endswith('"""'):
        return first[:-3]
    lines = [first] if first else []
    while True:
        try:
            line = read("... ")
        except (EOFError, KeyboardInterrupt):
            return None
        if line.rstrip().endswith('"""'):
            lines.append(line.rstrip()[:-3])
            return "\n".join(lines)
        lines.append(line)


def is_tty(stream: TextIO = sys.stdin) -> bool:
    return hasattr(stream, "isatty") and stream.isatty()
