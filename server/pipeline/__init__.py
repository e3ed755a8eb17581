"""A request's way to a worker and back: admission's checks (admission.py), the tokenizers
(tokenizer.py, ascii_bpe.py, tokie_ids.py), what a request asks for (outputs.py, request.py), the
router and the channels to the workers' rings (router.py, channel.py). May import observe and
config only.
"""
