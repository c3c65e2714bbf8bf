"""Megatron-LM functional-test case files without PyYAML: the YAML subset its
model_config.yaml files use, and MODEL_ARGS as the command line Megatron's
shell_test_utils/_run_training.sh builds from them. Light (no torch, no Megatron), so the GPU
scripts can use it before anything is installed."""

from __future__ import annotations


def read_flat_yaml(path: str) -> dict[str, object]:
    """The subset of YAML that model_config.yaml uses: top-level `key: scalar`, sections of
    indented `key: scalar`, and sections of indented `- scalar` list items.

    Returns top-level keys mapped to scalars, dicts or lists.
    (PyYAML is not a dependency of this project; the file stays valid YAML.)
    """
    out: dict[str, object] = {}
    name: str | None = None
    with open(path) as f:
        for raw in f:
            line = raw.split(" #", 1)[0].rstrip() if not raw.lstrip().startswith("#") else ""
            if not line.strip():
                continue
            if line.startswith(" "):
                if name is None:
                    raise ValueError(f"{path}: indented line {line.strip()!r} outside a section")
                item = line.strip()
                if item.startswith("- "):
                    out[name] = out[name] or []
                    out[name].append(_scalar(item[2:]))
                else:
                    key, _, value = item.partition(":")
                    out[name] = out[name] or {}
                    out[name][key] = _scalar(value.strip())
                continue
            key, _, value = line.partition(":")
            value = value.strip()
            out[key], name = (_scalar(value), None) if value else (None, key)
    return out


def _scalar(text: str):
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        return text[1:-1]
    if text in ("true", "false"):
        return text == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def model_args_argv(model_args: dict, env: dict[str, str]) -> list[str]:
    """MODEL_ARGS as the command line Megatron's `_run_training.sh` builds from them:
    `true` is a bare flag, `[a b]` is split into its words, `${VAR}` comes from `env`
    (its envsubst), anything else is one value."""
    argv: list[str] = []
    for key, value in model_args.items():
        if value is True:
            argv.append(key)
            continue
        text = str(value)
        for var, sub in env.items():
            text = text.replace("${" + var + "}", sub)
        if text.startswith("[") and text.endswith("]"):
            argv += [key, *text[1:-1].split()]
        else:
            argv += [key, text]
    return argv
