"""Generated token ids -> text pieces safe to send, ending at the first stop string (which is not sent).

Each step decodes the whole answer and releases only what can no longer change: a trailing U+FFFD
waits (a character spanning several byte-level tokens decodes once complete), and so do the last
characters that could be the start of a stop string.
"""


class TextStream:
    def __init__(self, tokenizer, stops):
        self.tokenizer = tokenizer
        self.stops = [stop for stop in stops if stop]
        self.token_ids = []
        self.sent = 0  # characters of the answer already released
        self.text = ""
        self.stopped = False

    def add(self, token_id):
        """Append one token; returns the newly releasable text ('' when nothing is)."""
        self.token_ids.append(token_id)
        self.text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        cut = min((index for index in (self.text.find(stop, max(0, self.sent - len(stop) + 1))
                                       for stop in self.stops) if index >= 0), default=None)
        if cut is not None:
            self.text, self.stopped = self.text[:cut], True
            return self.release(len(self.text))
        ready = len(self.text.rstrip("\ufffd"))
        for stop in self.stops:
            for length in range(min(len(stop) - 1, ready), 0, -1):
                if self.text[:ready].endswith(stop[:length]):
                    ready = min(ready, len(self.text[:ready]) - length)
                    break
        return self.release(ready)

    def finish(self):
        """Everything not yet released (the answer is over)."""
        return self.release(len(self.text))

    def release(self, end):
        piece = self.text[self.sent : max(end, self.sent)]
        self.sent = max(end, self.sent)
        return piece
