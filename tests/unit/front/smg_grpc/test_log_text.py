"""The gRPC path's prompt text for the request log: kept only when it encodes back to the ids smg sent."""

from transformers import AutoTokenizer

from warmup_tools.demo.prompts import SYSTEM_PROMPTS
from warmup_tools.front.smg_grpc.log_text import LogText


def test_a_rendered_chat_round_trips_and_ids_no_text_gives_are_logged_without_text(demo_assets):
    tokenizer = AutoTokenizer.from_pretrained(str(demo_assets.lm_dir))
    text = tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM_PROMPTS["legal"]},
                                          {"role": "user", "content": "is a verbal contract binding?"}],
                                         tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=True)
    log_text = LogText.from_folder(demo_assets.lm_dir)
    assert log_text(ids) == text and log_text.unmatched == 0
    # Ids no text encodes to (a word cut where the tokenizer would not cut it): logged without text.
    canonical = tokenizer.encode(" contracts", add_special_tokens=False)
    cut = tokenizer.encode(" contr", add_special_tokens=False) + tokenizer.encode("acts", add_special_tokens=False)
    assert cut != canonical and tokenizer.decode(cut) == tokenizer.decode(canonical)
    assert log_text(cut) is None and log_text.unmatched == 1
    assert log_text([10**9]) is None  # outside the vocabulary


def test_no_tokenizer_folder_means_no_text(tmp_path):
    assert LogText.from_folder(None) is None and LogText.from_folder(tmp_path) is None
