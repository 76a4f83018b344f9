"""What the evaluation scripts share, so that no script imports another.

    loading.py   find and load a trained model (model folder, out dir or checkpoint) with its tokenizer
    passkey.py   the passkey task: its wording, the training documents, the prompts and answer parsing
    chat.py      chat prompts cut to fit the context, and the preset prompts with their expected answers
    copying.py   per-digit losses on passkey answers: which half of copying a model has learned
"""
