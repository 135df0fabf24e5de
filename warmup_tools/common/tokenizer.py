"""A model folder's tokenizer without torch or transformers: ``tokenizer.json`` through the ``tokenizers`` library.

Every serving process (``tokenizer_cache``, ``embedding_cache``, ``lora_adapter``, the sidecar and its OpenAI
front) needs the LM's tokenizer only to encode, decode, count the vocabulary, find EOS, fingerprint the
tokenizer and render the chat template. ``transformers.AutoTokenizer`` does all of that by wrapping the same
``tokenizers.Tokenizer`` it reads from ``tokenizer.json``, but importing it imports torch (~200 MiB a process).
:class:`FolderTokenizer` reads the folder the way transformers 5's generic fast tokenizer (``TokenizersBackend``,
alias ``PreTrainedTokenizerFast``) reads it, and answers exactly as it does for everything this package asks:
``encode``, ``decode``, ``len``, ``eos_token_id``, ``get_vocab``, ``backend_tokenizer`` (so
:func:`~warmup_tools.common.digests.tokenizer_fingerprint` is unchanged, and with it block hashes, snapshots and
cache keys), ``chat_template`` and ``apply_chat_template(..., tokenize=False)``.

:func:`load_tokenizer` picks: a folder whose ``tokenizer_config.json`` names a model-specific tokenizer class
(transformers rebuilds those pipelines in Python, so only transformers answers exactly as transformers), or that
has no ``tokenizer.json`` (a slow, sentencepiece-only tokenizer), is read with ``AutoTokenizer``, and the process
says in its log that it imports transformers.

What transformers 5 does on load, and this module does too (``tokenization_utils_base.py`` and
``tokenization_utils_tokenizers.py``):

* ``add_bos_token``/``add_eos_token`` in ``tokenizer_config.json`` are ignored when ``tokenizer.json`` exists
  (its post-processor decides); a ``tokenizer.json`` with no post-processor gets ``TemplateProcessing("$A:0")``;
* the named special tokens (``bos_token`` ... ``mask_token``) come from ``tokenizer_config.json``, matched to its
  ``added_tokens_decoder``; without one, from ``special_tokens_map.json`` and ``tokenizer.json``'s added tokens.
  Those missing from the vocabulary, and the config's ``added_tokens_decoder`` entries, are added to it;
* the chat template is ``chat_template.jinja`` (plus ``additional_chat_templates/*.jinja``), else the config's;
* ``encode`` drops a ``tokenizer.json``'s truncation and padding first (transformers' default ``truncation=False``,
  ``padding=False``); ``decode`` applies ``clean_up_tokenization_spaces`` except to a BPE model.

The chat template renders in jinja2's ``ImmutableSandboxedEnvironment`` with transformers' settings and helpers
(``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, the ``generation`` tag, ``tojson`` without HTML escaping,
``raise_exception``, ``strftime_now``, restricted ``dict`` and ``namespace``) and the named special tokens as
variables: a template from the Hub is untrusted code.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, processors

from warmup_tools.common.errors import AssetError

LOGGER = logging.getLogger(__name__)

#: ``tokenizer_class`` values transformers reads with its generic fast tokenizer (tokenizer.json as it is).
GENERIC_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
#: The named special tokens, in transformers' order (``SPECIAL_TOKENS_ATTRIBUTES``).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
#: Largest tokenizer file read (a large vocabulary's tokenizer.json is tens of MB).
MAX_TOKENIZER_FILE_BYTES = 256 << 20
_CONFIG_FILE_BYTES = 16 << 20
_MIN_JINJA = (3, 1, 6)


class NotLightError(ValueError):
    """The folder's tokenizer is not one :class:`FolderTokenizer` reads exactly as transformers does."""


def load_tokenizer(folder: Path | str) -> Any:
    """The tokenizer of model folder ``folder``: a :class:`FolderTokenizer` where the folder allows it, else
    ``transformers.AutoTokenizer`` (logged: the process then imports transformers and torch)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise AssetError(f"tokenizer folder {folder} does not exist; build the demo assets with "
                         "`python -m warmup_tools assets` or point the setting at a model folder")
    try:
        return FolderTokenizer.from_folder(folder)
    except NotLightError as exc:
        LOGGER.warning("the tokenizer in %s is read with transformers.AutoTokenizer (%s): this process imports "
                       "transformers and torch", folder, exc)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as exc:  # noqa: BLE001 (transformers raises OSError, ValueError, KeyError... on a bad folder)
        raise AssetError(f"the tokenizer in {folder} cannot be loaded: {type(exc).__name__}: {exc}") from None


class FolderTokenizer:
    """A model folder's fast tokenizer, answering as transformers' ``TokenizersBackend`` does (see the module)."""

    def __init__(self, backend: Tokenizer, *, special_tokens: Mapping[str, str],
                 chat_template: str | dict[str, str] | None = None,
                 extra_special_tokens: Sequence[str] = (), clean_up_tokenization_spaces: bool = False,
                 clean_up_bpe: bool = False, name_or_path: str = "") -> None:
        self._backend = backend
        #: The special tokens that are set, as text: the named ones (``bos_token`` ... ``mask_token``), then the
        #: model's own (``image_token`` ...); a chat template sees each as a variable.
        self.special_tokens_map = {name: str(token) for name, token in special_tokens.items() if token is not None}
        #: Special tokens without a name (``additional_special_tokens``).
        self.extra_special_tokens = [str(token) for token in extra_special_tokens]
        self.chat_template = chat_template
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces
        self._clean_up_bpe = clean_up_bpe
        self.name_or_path = name_or_path

    @classmethod
    def from_folder(cls, folder: Path | str) -> "FolderTokenizer":
        """Read ``folder``; :class:`NotLightError` when transformers would not read it as ``tokenizer.json`` says
        (no such file, a model-specific tokenizer class, the Mistral regex fix asked for), :class:`AssetError`
        when a file is unreadable."""
        folder = Path(folder)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise NotLightError("no tokenizer.json")
        config = _json_file(folder / "tokenizer_config.json") or {}
        declared = config.pop("tokenizer_class", None)
        if declared is None:
            # NOTE: without a class in tokenizer_config.json, transformers picks one from config.json's
            # model_type (llama -> LlamaTokenizer, which rebuilds the pipeline): only a folder without one is
            # surely read generically.
            model_config = _json_file(folder / "config.json") or {}
            if model_config.get("model_type") or model_config.get("tokenizer_class"):
                raise NotLightError(f"no tokenizer_class, and config.json's model_type "
                                    f"{model_config.get('model_type')!r} picks transformers' class")
        elif declared not in GENERIC_CLASSES:
            raise NotLightError(f"tokenizer_class {str(declared)[:80]!r} is not the generic fast tokenizer")
        if config.get("fix_mistral_regex"):
            raise NotLightError("fix_mistral_regex is set")
        if config.get("auto_map"):
            raise NotLightError("auto_map names remote code")
        _check_size(tokenizer_file, MAX_TOKENIZER_FILE_BYTES)
        try:
            backend = Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # noqa: BLE001 (the Rust loader raises Exception with its message)
            raise AssetError(f"{tokenizer_file} is not a tokenizers file: {str(exc)[:200]}") from None
        return cls._build(folder, backend, config)

    @classmethod
    def _build(cls, folder: Path, backend: Tokenizer, config: dict[str, Any]) -> "FolderTokenizer":
        # tokenization_utils_base._from_pretrained: with tokenizer.json, add_bos/eos_token are the file's.
        config.pop("add_bos_token", None)
        config.pop("add_eos_token", None)
        chat_template = _chat_template(folder, config.pop("chat_template", None))
        if "additional_special_tokens" in config and not config.get("extra_special_tokens"):
            config["extra_special_tokens"] = config.pop("additional_special_tokens")
        # NOTE: the model's own *_token entries (image_token ...): transformers takes the textual ones first, the
        # serialised ones (and those special_tokens_map.json adds) later, and puts the later ones first.
        explicit = {key: config.pop(key) for key in list(config)
                    if key not in SPECIAL_TOKEN_NAMES and key.endswith("_token") and isinstance(config[key], str)}
        if isinstance(config.get("extra_special_tokens"), dict):
            explicit.update(config.pop("extra_special_tokens"))
        added_decoder, added_map = _added_tokens(folder, config, backend)
        if isinstance(config.get("extra_special_tokens"), dict):
            explicit.update(config.pop("extra_special_tokens"))
        for key in SPECIAL_TOKEN_NAMES:
            if key in config:
                value = _added_token(config[key])
                if value is not None and added_map:
                    value = added_map.get(str(value), value)
                config[key] = value
        later = {key: _added_token(config.pop(key)) for key in list(config) if key not in SPECIAL_TOKEN_NAMES
                 and key.endswith("_token") and isinstance(config[key], (str, dict, AddedToken))}
        model_specific = {**later, **{key: _added_token(value) for key, value in explicit.items()}}

        # TokenizersBackend.__init__: the file's truncation and padding, re-applied; padding names a pad token.
        truncation, padding = backend.truncation, backend.padding
        if truncation is not None:
            backend.enable_truncation(**truncation)
        else:
            backend.no_truncation()
        if padding is not None:
            backend.enable_padding(**padding)
            config.setdefault("pad_token", padding["pad_token"])
        named: dict[str, Any] = {key: config[key] for key in SPECIAL_TOKEN_NAMES if config.get(key) is not None}
        named.update({key: value for key, value in model_specific.items() if value is not None})
        extras = [_added_token(tok) for tok in (config.get("extra_special_tokens") or [])
                  if isinstance(tok, (str, dict, AddedToken))]
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))

        # NOTE: transformers compares the config's added tokens against the ids of the backend's (a dict's keys),
        # so it re-adds all of them; the backend skips those it has. Done the same way for the same vocabulary.
        tokens_to_add: list[Any] = [token for _, token in sorted(added_decoder.items(), key=lambda item: item[0])]
        encoder = [token.content for token in backend.get_added_tokens_decoder().values()]
        encoder += [str(token) for token in tokens_to_add]
        for value in [*named.values(), *extras]:
            if value is not None and str(value) not in encoder and value not in tokens_to_add:
                tokens_to_add.append(value)
        if tokens_to_add:
            named_text = [str(value) for value in named.values() if value]
            ready = []
            for token in tokens_to_add:
                if isinstance(token, str):
                    token = AddedToken(token, special=True)
                elif not token.special and str(token) in named_text:
                    token.special = True
                ready.append(token)
            backend.add_tokens(ready)
        if backend.post_processor is None:
            backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1",
                                                                   special_tokens=[])
        return cls(backend, special_tokens=named, extra_special_tokens=[tok for tok in extras if tok is not None],
                   chat_template=chat_template,
                   clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
                   clean_up_bpe=bool(config.get(
                       "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)),
                   name_or_path=str(folder))

    # -- what the package uses -------------------------------------------------------------------------------

    @property
    def backend_tokenizer(self) -> Tokenizer:
        """The ``tokenizers.Tokenizer`` (what :func:`~warmup_tools.common.digests.tokenizer_fingerprint` hashes)."""
        return self._backend

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (``add_special_tokens``: the post-processor's BOS/EOS or [CLS]/[SEP])."""
        if not isinstance(text, str):
            raise ValueError("text input must be of type `str`")
        # NOTE: transformers' encode (truncation=False, padding=False) drops the file's truncation and padding
        # from the backend before encoding; the fingerprint of such a file changes then, as it does there.
        if self._backend.truncation is not None:
            self._backend.no_truncation()
        if self._backend.padding is not None:
            self._backend.no_padding()
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Any, skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None) -> Any:
        """Text of ``token_ids`` (an id, a sequence of them, or a batch of sequences: then a list of texts)."""
        ids = token_ids.tolist() if hasattr(token_ids, "tolist") else token_ids
        if isinstance(ids, (list, tuple)) and ids and isinstance(ids[0], (list, tuple)):
            return [self._decode(seq, skip_special_tokens, clean_up_tokenization_spaces) for seq in ids]
        return self._decode(ids, skip_special_tokens, clean_up_tokenization_spaces)

    def __len__(self) -> int:
        """The vocabulary with the added tokens."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        """The base vocabulary (without the added tokens)."""
        return self._backend.get_vocab_size(with_added_tokens=False)

    def get_vocab(self) -> dict[str, int]:
        return self._backend.get_vocab(with_added_tokens=True)

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> Any:
        if isinstance(tokens, str):
            return self._token_id(tokens)
        return [self._token_id(token) for token in tokens]

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> Any:
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        return [self._backend.id_to_token(int(index)) for index in ids]

    @property
    def added_tokens_decoder(self) -> dict[int, AddedToken]:
        return self._backend.get_added_tokens_decoder()

    @property
    def all_special_tokens(self) -> list[str]:
        return list(dict.fromkeys([*self.special_tokens_map.values(), *self.extra_special_tokens]))

    @property
    def all_special_ids(self) -> list[int]:
        return [self._token_id(token) for token in self.all_special_tokens]

    def __getattr__(self, name: str) -> Any:
        # bos_token, eos_token_id, pad_token, ...: as transformers answers them (None when unset).
        base = name.removesuffix("_id")
        if base.endswith("_token"):
            tokens = self.__dict__.get("special_tokens_map", {})
            if base in tokens or base in SPECIAL_TOKEN_NAMES:
                token = tokens.get(base)
                return token if token is None or base == name else self._token_id(token)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def get_chat_template(self, chat_template: str | None = None, tools: list | None = None) -> str:
        """The template ``apply_chat_template`` renders (a named one of several, or the default)."""
        if isinstance(self.chat_template, dict):
            templates = self.chat_template
            if chat_template is not None and chat_template in templates:
                return templates[chat_template]
            if chat_template is None:
                if tools is not None and "tool_use" in templates:
                    return templates["tool_use"]
                if "default" in templates:
                    return templates["default"]
                raise ValueError("This model has multiple chat templates with no default specified! Available "
                                 f"template names are {sorted(templates)}.")
        elif chat_template is None:
            if self.chat_template is None:
                raise ValueError("Cannot use chat template functions because tokenizer.chat_template is not set "
                                 "and no template argument was passed!")
            return self.chat_template
        return chat_template

    def apply_chat_template(self, conversation: Sequence[Any], tools: list[dict] | None = None,
                            documents: list[dict] | None = None, chat_template: str | None = None,
                            add_generation_prompt: bool = False, tokenize: bool = True, **kwargs: Any) -> str:
        """``conversation`` (a list of message dicts) rendered as text, as transformers renders it; only
        ``tokenize=False`` (encode the text for ids)."""
        if tokenize:
            raise ValueError("FolderTokenizer.apply_chat_template renders text only: pass tokenize=False and "
                             "encode the result with add_special_tokens=False")
        for unsupported in ("continue_final_message", "return_assistant_tokens_mask", "sanitize_control_tokens"):
            if kwargs.pop(unsupported, False):
                raise ValueError(f"FolderTokenizer.apply_chat_template does not support {unsupported}")
        for ignored in ("padding", "truncation", "max_length", "return_tensors", "return_dict", "tokenizer_kwargs"):
            kwargs.pop(ignored, None)
        template = self.get_chat_template(chat_template, tools)
        if isinstance(conversation, (list, tuple)) and len(conversation) == 0:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        if isinstance(conversation, (list, tuple)) and isinstance(conversation[0], (list, tuple)):
            raise ValueError("FolderTokenizer.apply_chat_template renders one conversation at a time")
        messages = _normalize_messages(conversation)
        if tools is not None and not all(isinstance(tool, dict) for tool in tools):
            raise ValueError("Tools should be JSON schemas (dicts)")
        if documents is not None and not all(isinstance(document, dict) for document in documents):
            raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
        variables = _plain({**self.special_tokens_map, **kwargs})
        chat = _alias_reasoning(_plain(messages))
        return _compiled(template).render(messages=chat, tools=_plain(tools), documents=_plain(documents),
                                          add_generation_prompt=add_generation_prompt, **variables)

    # -- helpers ---------------------------------------------------------------------------------------------

    def _token_id(self, token: str) -> int | None:
        index = self._backend.token_to_id(token)
        if index is None:
            unk = self.special_tokens_map.get("unk_token")
            return None if unk is None or unk == token else self._backend.token_to_id(unk)
        return index

    def _decode(self, ids: Any, skip_special_tokens: bool, clean_up: bool | None) -> str:
        ids = [int(ids)] if isinstance(ids, int) else [int(index) for index in ids]
        text = self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        clean_up = self.clean_up_tokenization_spaces if clean_up is None else clean_up
        if clean_up and (type(self._backend.model).__name__ != "BPE" or self._clean_up_bpe):
            text = _clean_up_tokenization(text)
        return text


# -- reading the folder ---------------------------------------------------------------------------------------


def _check_size(path: Path, limit: int) -> None:
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise AssetError(f"{path} cannot be read: {exc.strerror}") from None
    if size > limit:
        raise AssetError(f"{path} is {size} bytes, over the {limit} bytes a tokenizer file may have")


def _json_file(path: Path) -> Any:
    if not path.is_file():
        return None
    _check_size(path, _CONFIG_FILE_BYTES)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AssetError(f"{path} is not readable JSON: {exc}") from None


def _text_file(path: Path) -> str:
    _check_size(path, _CONFIG_FILE_BYTES)
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise AssetError(f"{path} is not readable text: {exc}") from None


def _chat_template(folder: Path, configured: Any) -> str | dict[str, str] | None:
    """``chat_template.jinja`` and ``additional_chat_templates/*.jinja`` first, then the config's own."""
    templates: dict[str, str] = {}
    if (folder / "chat_template.jinja").is_file():
        templates["default"] = _text_file(folder / "chat_template.jinja")
    extra_dir = folder / "additional_chat_templates"
    if extra_dir.is_dir():
        for path in extra_dir.glob("*.jinja"):
            templates[path.name.removesuffix(".jinja")] = _text_file(path)
    if len(templates) == 1 and "default" in templates:
        return templates["default"]
    if templates:
        return templates
    if isinstance(configured, (list, tuple)):
        return {entry["name"]: entry["template"] for entry in configured}
    return configured


def _added_token(value: Any) -> Any:
    """A config's token entry as transformers holds it: a string, or an ``AddedToken`` for a serialised one."""
    if isinstance(value, dict):
        fields = {key: item for key, item in value.items() if key != "__type"}
        return AddedToken(**fields)
    return value


def _added_tokens(folder: Path, config: dict[str, Any],
                  backend: Tokenizer) -> tuple[dict[int, AddedToken], dict[str, AddedToken]]:
    """The config's ``added_tokens_decoder``, or (legacy) ``special_tokens_map.json`` merged into ``config`` and
    ``tokenizer.json``'s added tokens (read from ``backend``, which loaded them)."""
    decoder: dict[int, AddedToken] = {}
    if "added_tokens_decoder" in config:
        for index, token in (config.get("added_tokens_decoder") or {}).items():
            if not isinstance(token, (dict, AddedToken)):
                raise AssetError(f"{folder / 'tokenizer_config.json'}: added_tokens_decoder holds a "
                                 f"{type(token).__name__}, not a token")
            decoder[int(index)] = token if isinstance(token, AddedToken) else AddedToken(
                **{key: item for key, item in token.items() if key != "__type"})
    else:
        special_map = _json_file(folder / "special_tokens_map.json") or {}
        for key, value in special_map.items():
            if isinstance(value, dict) and key != "extra_special_tokens":
                value = AddedToken(**{k: v for k, v in value.items() if k not in ("special", "__type")},
                                   special=True)
            elif key == "extra_special_tokens" and isinstance(value, list):
                existing = list(config.get("extra_special_tokens") or [])
                for token in value:
                    token = AddedToken(**token, special=True) if isinstance(token, dict) else token
                    if token not in existing:
                        existing.append(token)
                value = existing
            config[key] = value
        decoder.update(backend.get_added_tokens_decoder())
    return decoder, {str(token): token for token in decoder.values()}


def _clean_up_tokenization(text: str) -> str:
    return (text.replace(" .", ".").replace(" ?", "?").replace(" !", "!").replace(" ,", ",").replace(" ' ", "'")
            .replace(" n't", "n't").replace(" 'm", "'m").replace(" 's", "'s").replace(" 've", "'ve")
            .replace(" 're", "'re"))


# -- the chat template ---------------------------------------------------------------------------------------

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _normalize_messages(conversation: Any) -> list[dict]:
    messages = getattr(conversation, "messages", conversation)
    normalized = []
    for message in messages:
        if dataclasses.is_dataclass(message) and not isinstance(message, type):
            message = {field.name: getattr(message, field.name) for field in dataclasses.fields(message)}
        elif callable(getattr(message, "model_dump", None)):
            message = message.model_dump()
        if not isinstance(message, Mapping):
            raise TypeError(f"Chat messages should be dicts, dataclasses or pydantic models, but got {message!r}.")
        normalized.append({key: value for key, value in message.items() if value is not None})
    return normalized


def _plain(value: Any) -> Any:
    """What a template may see: plain JSON types rebuilt, anything else an inert ``<TypeName>`` placeholder."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if hasattr(value, "item") and type(value).__module__ == "numpy":
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: _plain(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _alias_reasoning(chat: list) -> list:
    aliased = []
    for message in chat:
        if isinstance(message, dict):
            reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased


@lru_cache(maxsize=16)
def _compiled(template: str) -> Any:
    return _environment().from_string(template)


@lru_cache(maxsize=1)
def _environment() -> Any:
    """transformers' chat-template environment (``utils/chat_template_utils.py``), without its mask tracker."""
    import jinja2
    import jinja2.exceptions
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if tuple(int(part) for part in jinja2.__version__.split(".")[:3] if part.isdigit()) < _MIN_JINJA:
        raise ImportError(f"chat templates need jinja2>=3.1.6 (older ones have sandbox escapes), "
                          f"found {jinja2.__version__}")

    class GenerationTag(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: transformers marks assistant text with it; rendered as is."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    class TemplateDict:
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                    "Please rename the attribute.")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env
