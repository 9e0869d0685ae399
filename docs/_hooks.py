"""Build hook: the benchmark plots and work-precision sweeps, taken from
`benchmarks/results/` at build time so that the site never holds stale copies.

- Every `benchmarks/results/*.png` is added to the site as
  `benchmarks/results/<name>.png`, next to the benchmarks page, so the relative image
  links of `benchmarks/README.md` (included by that page) resolve as they do on GitHub.
- Snippets (`--8<--`) are read relative to the repository root, wherever mkdocs is
  run from.
- The marker `<!-- sweep-results -->` on a page is replaced by every sweep that
  `python benchmarks/run.py --sweep` has written (its table and its two plots), or by
  a sentence saying that none has been run yet.
"""

import pathlib

from mkdocs.structure.files import File


ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SWEEP_MARKER = "<!-- sweep-results -->"


def on_config(config):
    snippets = config.mdx_configs.setdefault("pymdownx.snippets", {})
    snippets["base_path"] = [str(ROOT)]
    return config


def on_files(files, config):
    for png in sorted(RESULTS.glob("*.png")):
        uri = f"benchmarks/results/{png.name}"
        if files.get_file_from_path(uri) is None:
            files.append(File.generated(config, uri, abs_src_path=str(png)))
    return files


def _sweep_markdown(page_uri: str) -> str:
    sweeps = sorted(RESULTS.glob("sweep_*.md"))
    if not sweeps:
        return (
            "The work-precision sweep has not been run yet. "
            "`python benchmarks/run.py --sweep` writes its table "
            "(`benchmarks/results/sweep_<problem>_<N>_<dtype>.md`) and two plots "
            "(`..._forward.png`, `..._gradient.png`); they appear here on the next "
            "build."
        )
    base = pathlib.PurePosixPath(page_uri).parent
    parts = []
    for md in sweeps:
        lines = md.read_text().splitlines()
        title = lines[0].lstrip("# ").strip() if lines else md.stem
        body = "\n".join(lines[1:]).replace("\n# ", "\n#### ")
        parts.append(f"### {title}\n\n{body}\n")
        for kind in ("forward", "gradient"):
            png = RESULTS / f"{md.stem}_{kind}.png"
            if png.exists():
                target = pathlib.PurePosixPath("benchmarks/results") / png.name
                rel = target.relative_to(base) if base.parts else target
                parts.append(f"![{md.stem} {kind}]({rel})\n")
    return "\n".join(parts)


def on_page_markdown(markdown, page, config, files):
    if SWEEP_MARKER in markdown:
        markdown = markdown.replace(SWEEP_MARKER, _sweep_markdown(page.file.src_uri))
    return markdown
