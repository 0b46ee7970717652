"""config.json parsed without its family's configuration module until a field needs it.

Importing a family's transformers config class can cost seconds: transformers 5.17's
`configuration_mixtral` (and every other) runs `@auto_docstring`, which imports its modeling,
generation and distributed stack (5-12 s on the H200 machine, where `make_plan` needs no model).
So `parse_file_config` parses the file with transformers' generic `PretrainedConfig`, and a
`FileConfig` reads from the family's class, parsed from the same fields once, only what the file
does not hold itself: a field save_pretrained left out because it equals the class default, an
`attribute_map` alias (DBRX's `hidden_size` is `d_model`), a property (Jamba's `layers_num_experts`),
and every nested object (DBRX's `ffn_config`, Llama-4's `text_config`: sub-configs with defaults of
their own). Fields the file holds read as written, which is what the family's class keeps of them.
Adapters also ask for fields a family does not have at all (Mixtral's `moe_intermediate_size`,
`num_nextn_predict_layers`): `class_names` reads which names the class can have from its source,
without importing it, so those are absent at once, as on the class.

What differs from the class: its own validation of fields nothing here reads (the executor in `run/`
parses the config with the family's class itself), and class-level settings (tensor-parallel plans,
`keys_to_ignore_at_inference`), which are the generic class's.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path

from huggingface_hub.errors import StrictDataclassError
from transformers import CONFIG_MAPPING, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES, model_type_to_module_name

from quantize_moe.errors import UserError

PARSE_ERRORS = (TypeError, ValueError, StrictDataclassError)  # transformers 5 validates fields strictly
# Where PretrainedConfig.get_text_config looks for a nested decoder or encoder config.
TEXT_CONFIG_NAMES = ("text_config", "decoder", "generator", "text_encoder")
STATE = "_family_state"  # FileConfig's own entry of __dict__: the fields and, once parsed, the family config


def parse_with(config_class: type[PretrainedConfig], fields: dict, family_name: str, where: str) -> PretrainedConfig:
    """`fields` parsed by `config_class`; a refusal is one sentence naming the file."""
    try:
        return config_class.from_dict(fields)
    except PARSE_ERRORS as e:
        raise UserError(f"{where} could not be parsed as a {family_name} config ({e}); "
                        "restore the original config.json.") from None


def family_config(fields: dict, model_type: str, family_name: str, where: str) -> PretrainedConfig:
    """`fields` parsed by the family's own config class (importing its module)."""
    return parse_with(CONFIG_MAPPING[model_type], fields, family_name, where)


class FileConfig(PretrainedConfig):
    """config.json's flat fields as written; anything else from the family's config class (module docstring)."""

    def __getattr__(self, name: str):  # only reached for names the file's fields do not hold
        # Private names (copy, pickle, transformers' probes), transformers' own parse of the fields (before
        # STATE is set) and names neither the file (its nested objects) nor the family's class (`class_names`)
        # has need no family parse.
        if name.startswith("_") or STATE not in self.__dict__:
            raise AttributeError(name)
        fields, model_type = self.__dict__[STATE]["arguments"][:2]
        known = class_names(model_type)
        if known is not None and name not in known and name not in fields:
            raise AttributeError(name)
        return getattr(self.parsed_by_family(), name)

    def parsed_by_family(self) -> PretrainedConfig:
        """The same fields parsed by the family's config class, on first use (a `UserError` when the class
        refuses them)."""
        state = self.__dict__[STATE]
        if "config" not in state:
            state["config"] = family_config(*state["arguments"])
        return state["config"]

    def get_text_config(self, *args, **kwargs) -> PretrainedConfig:
        """The family's text config when the file names one (a nested object, or garbage its class reports),
        otherwise this config."""
        if STATE not in self.__dict__:  # transformers' own parse of the fields
            return super().get_text_config(*args, **kwargs)
        fields = self.__dict__[STATE]["arguments"][0]
        if all(fields.get(name) is None for name in TEXT_CONFIG_NAMES):
            return self
        family = self.parsed_by_family()
        text = family.get_text_config(*args, **kwargs)
        return self if text is family else text

    def to_dict(self) -> dict:
        output = super().to_dict()
        output.pop(STATE, None)
        return output


@functools.cache
def class_names(model_type: str) -> frozenset[str] | None:
    """Every name the family's config class could give an instance (fields, `attribute_map` aliases,
    properties and methods, whatever its code assigns to `self`, and more: arguments, class attributes),
    read from its module's source without importing it; None, so every name may be the class's, when the
    class is not found there or has bases other than PreTrainedConfig."""
    class_name = CONFIG_MAPPING_NAMES.get(model_type)
    spec = importlib.util.find_spec(f"transformers.models.{model_type_to_module_name(model_type)}")
    if class_name is None or spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        for path in sorted(Path(folder).glob("configuration_*.py")):
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.ClassDef) and node.name == class_name:
                    return _names_in(node)
    return None


def _names_in(cls: ast.ClassDef) -> frozenset[str] | None:
    if any(not (isinstance(b, ast.Name) and b.id in ("PreTrainedConfig", "PretrainedConfig")) for b in cls.bases):
        return None  # fields inherited from another family's class
    names = set()
    for node in ast.walk(cls):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
            names.update(a.arg for a in node.args.args + node.args.kwonlyargs)
        elif isinstance(node, ast.Dict):  # attribute_map's aliases, among other dicts
            names.update(k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            return None  # names made at run time
    return frozenset(names)


def parse_file_config(fields: dict, model_type: str, family_name: str, where: str) -> PretrainedConfig:
    """A `FileConfig` of `fields`; a file the generic class refuses is parsed by the family's class, whose
    verdict (and error) is today's."""
    try:
        config = FileConfig.from_dict({k: v for k, v in fields.items() if not isinstance(v, dict)})
    except PARSE_ERRORS + (KeyError,):  # KeyError: transformers' rope checks
        return family_config(fields, model_type, family_name, where)
    config.__dict__[STATE] = {"arguments": (fields, model_type, family_name, where)}
    return config
