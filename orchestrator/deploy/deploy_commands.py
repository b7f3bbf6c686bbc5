"""Click command deploy (thin: parse options, call deploy.sync, print)."""
from __future__ import annotations

import json

import click

from orchestrator.errors import TargetsFailed
from orchestrator.ui import State, emit, json_option, progress_bars, size_text


@click.command()
@click.argument("names", nargs=-1, metavar="TARGET...")
@click.option("--dry-run", is_flag=True, help="List what would change; send nothing.")
@click.option("--source", metavar="DIR", help="Folder to ship (default: this checkout; required elsewhere).")
@click.option("--install-deps", is_flag=True, help="pip-install the trainer's missing requirements (never torch).")
@click.option("--all-files", is_flag=True,
              help="Send every file of the source (default in a git checkout: what git tracks, plus untracked "
                   "files .gitignore does not exclude).")
@click.option("--verify", is_flag=True,
              help="Hash every file of the live release (default: sizes and mtimes, hashes where they differ).")
@json_option
@click.pass_obj
def deploy(state: State, names, dry_run, source, install_deps, all_files, verify, as_json):
    """Sync code into WORKDIR/releases/ID on each target and flip WORKDIR/current atomically."""
    from orchestrator.deploy import sync as deploy_mod

    root, _ = deploy_mod.source_root(source)      # refuses outside a checkout without --source
    shipping = f"{root} ({'--source' if source else 'this checkout'})"
    results = deploy_mod.deploy(state.inv, list(names), source=source, dry_run=dry_run,
                                install_deps=install_deps, verify=verify, all_files=all_files,
                                progress=None if as_json else progress_bars(),
                                on_line=lambda t, line: click.echo(f"[{t}] {line}", err=True))
    doc = {"source": str(root), "targets": {n: r.as_json() for n, r in results.items()}}
    lines = [f"shipping {shipping}"]
    for r in results.values():
        if not r.ok:
            lines.append(f"{r.target}: FAILED: {r.error}")
            continue
        if r.dry_run:
            lines.append(f"{r.target}: would send {r.files_sent} file(s) ({size_text(r.bytes_sent)}), "
                         f"delete {r.files_deleted}")
            lines += [f"  + {shown(p)}" for p in r.changed] + [f"  - {shown(p)}" for p in r.deleted]
        elif r.unchanged:
            lines.append(f"{r.target}: up to date at {r.release} ({r.seconds:.2f} s)")
        else:
            lines.append(f"{r.target}: release {r.release}: sent {r.files_sent} file(s) "
                         f"({size_text(r.bytes_sent)}), deleted {r.files_deleted} ({r.seconds:.2f} s)")
        if r.repaired:
            lines.append(("  would repair" if r.dry_run else "  repaired")
                         + f" {len(r.repaired)} missing or damaged file(s) of the live release: "
                         + ", ".join(map(shown, r.repaired[:5]))
                         + (" ..." if len(r.repaired) > 5 else ""))
        if r.sparse:
            files = ", ".join(f"{shown(p)} ({size_text(size)}, {size_text(disk)} on disk here)"
                              for p, (size, disk) in r.sparse.items())
            lines.append(("  would send" if r.dry_run else "  sent") + " sparse file(s) in full, holes as zeros "
                         f"(they take their whole size there): {files}")
        if r.left_out:
            lines.append("  left out (the tool's own output, never shipped): "
                         + ", ".join(f"{shown(p)}/ ({kind})" for p, kind in sorted(r.left_out.items())))
        lines.append(f"  python {r.python}, torch {r.torch or 'not installed'}")
        if r.deps is not None:
            installed = r.deps.get("changed") or []
            lines.append(f"  requirements: installed {', '.join(installed)}" if installed
                         else "  requirements: already installed")
    emit(as_json, doc, "\n".join(lines))
    failed = {r.target: r.error or "failed" for r in results.values() if not r.ok}
    if failed:
        raise TargetsFailed(failed)


def shown(path: str) -> str:
    """A file name as one line can show it: quoted (JSON escapes) when it has a control character
    or space at either end, so a name cannot fake a line of the listing."""
    return path if path.isprintable() and path == path.strip() else json.dumps(path)


