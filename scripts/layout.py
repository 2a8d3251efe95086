#!/usr/bin/env python3
"""Checks the library crates' layout: no source file over the line limit, and no circle
between files in the `use` graph.

    scripts/layout.py [--max-lines N] [--graph]

Each `consumer-*/src` tree, `bench/src` and `chaos/src` is read on its own. A file depends on another when it names a
path into it: `use crate::inbox::Backend`, `crate::key::check_key(...)`, `super::Claim`,
or a child module's path (`postgres::Dialect` in `inbox/mod.rs`). A name the crate root
re-exports (`crate::Error`) is followed to the module that defines it. `mod x;`
declarations and inline `#[cfg(test)] mod … { }` modules are not edges (a test module in
a file of its own, `mod tests;`, is read as any file). Exits 1 with
every finding listed, 0 when the layout holds. `--graph` prints the edges.
"""

import argparse
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PATH = re.compile(r"\b(crate|super|self)((?:::[A-Za-z_][A-Za-z0-9_]*)+)")
USE_BLOCK = re.compile(r"\buse\s+(crate|super|self)::\{([^;]*)\};", re.S)
INLINE_TESTS = re.compile(r"#\[cfg\(test\)\]\s*(?:pub(?:\([a-z]+\))?\s+)?mod\s+[a-z_]+\s*\{")
REEXPORT = re.compile(r"pub\s+use\s+([a-z_][a-z0-9_]*)((?:::[A-Za-z_][A-Za-z0-9_]*)*)::(\{[^;]*\}|[A-Za-z_][A-Za-z0-9_]*)\s*;", re.S)


def strip(text):
    """The code without comments, strings and inline `#[cfg(test)]` modules."""
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r'r#*"(?:.|\n)*?"#*', '""', text)
    text = re.sub(r'"(?:\\.|[^"\\])*"', '""', text)
    text = re.sub(r"'(?:\\.|[^'\\\n])'", "' '", text)
    # An inline test module (`#[cfg(test)] mod tests { ... }`) is cut out whole; a declared
    # one (`mod tests;`) is a file of its own, read as any other.
    for cut in reversed(list(INLINE_TESTS.finditer(text))):
        end = closing_brace(text, cut.end() - 1)
        text = text[: cut.start()] + text[end + 1 :]
    return text


def closing_brace(text, open_at):
    """The index of the brace that closes the one at `open_at` (the end, if none does)."""
    depth = 0
    for i in range(open_at, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
    return len(text) - 1


def module_files(src):
    """Module path (tuple of names; () is the root) -> file."""
    mods = {}
    for f in src.rglob("*.rs"):
        rel = f.relative_to(src).with_suffix("")
        parts = list(rel.parts)
        if parts in (["lib"], ["main"]):
            parts = []
        elif parts[-1] == "mod":
            parts = parts[:-1]
        mods[tuple(parts)] = f
    return mods


def reexports(mods):
    """Name -> module path, for names the root re-exports with `pub use module::Name`."""
    names = {}
    root = mods.get(())
    if root is None:
        return names
    for m in REEXPORT.finditer(strip(root.read_text())):
        path = (m.group(1),) + tuple(p for p in m.group(2).split("::") if p)
        items = m.group(3).strip("{}")
        for item in items.split(","):
            item = item.strip().split(" as ")[-1].strip()
            if item:
                names[item] = path
    return names


def resolve(mods, base, parts):
    """The longest module prefix of `base + parts` that is a file's module."""
    full = list(base) + list(parts)
    for n in range(len(full), -1, -1):
        if tuple(full[:n]) in mods:
            return tuple(full[:n]), full[n:]
    return (), full


def edges_of(mods, names, mod, text):
    code = strip(text)
    found = set()
    paths = []
    for m in USE_BLOCK.finditer(code):
        for inner in re.split(r"[,{}]", m.group(2)):
            inner = inner.strip().split(" as ")[0].strip()
            if inner:
                paths.append((m.group(1), [p for p in inner.split("::") if p]))
    for m in PATH.finditer(code):
        paths.append((m.group(1), [p for p in m.group(2).split("::") if p]))
    children = {k[-1] for k in mods if len(k) == len(mod) + 1 and k[: len(mod)] == mod}
    for m in re.finditer(r"(?<![:\w])([a-z_][a-z0-9_]*)::[A-Za-z_{]", code):
        if m.group(1) in children:
            paths.append(("self", [m.group(1)]))
    for anchor, parts in paths:
        if anchor == "crate":
            base = ()
        elif anchor == "super":
            base = mod[:-1]
        else:
            base = mod
        target, rest = resolve(mods, base, parts)
        if target == () and rest and rest[0] in names:
            target, _ = resolve(mods, names[rest[0]], [])
        if target != mod and target != ():
            found.add(target)
    return found


def cycles(graph):
    """Every strongly connected set of more than one file (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-lines", type=int, default=600)
    ap.add_argument("--graph", action="store_true")
    args = ap.parse_args()
    problems = []
    for src in sorted(ROOT.glob("consumer-*/src")) + [ROOT / "bench/src", ROOT / "chaos/src"]:
        mods = module_files(src)
        names = reexports(mods)
        graph = {}
        for mod, f in mods.items():
            text = f.read_text()
            lines = text.count("\n")
            if lines > args.max_lines:
                problems.append(f"{f.relative_to(ROOT)}: {lines} lines (at most {args.max_lines})")
            graph[mod] = edges_of(mods, names, mod, text)
        name = lambda m: str(mods[m].relative_to(ROOT))
        if args.graph:
            for mod in sorted(graph):
                for dep in sorted(graph[mod]):
                    print(f"{name(mod)} -> {name(dep)}")
        for group in cycles(graph):
            problems.append("circle: " + " <-> ".join(name(m) for m in group))
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        sys.exit(1)
    print("layout: every file within the limit, no circle between files")


if __name__ == "__main__":
    main()
