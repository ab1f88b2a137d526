"""The server's named limits and defaults, in one place: the CLI shows them, the app and the
protocol enforce them. Each has a `forerun serve` option where it is a deployment choice."""

DEFAULT_HOST = "127.0.0.1"  # loopback: other machines cannot reach the server unless asked
DEFAULT_PORT = 8000
DEFAULT_SLOTS = 16  # --max-concurrent: requests decoded at once (members of one batch)
DEFAULT_QUEUE = 64  # --max-queue: requests waiting to join the batch; beyond this, 429
DEFAULT_KV_FRACTION = 0.25  # --kv-cache-gb unset: this share of the memory available at start
DEFAULT_BATCH_TOKENS = 512  # --max-batch-tokens: rows of one target pass
SPEC_POLICIES = ("adaptive", "always", "off")  # --spec-policy
MAX_BODY_BYTES = 1 << 20  # --max-body-bytes: a larger request body is refused with 413
MAX_TOKENS_LIMIT = 4096  # --max-tokens-limit: the largest max_tokens a request may ask for
MAX_K = 16  # the longest draft a request may ask for
MAX_N = 8  # choices per request
MAX_LOGPROBS = 20  # alternatives per token's logprob, as OpenAI
MAX_STOP = 4  # stop strings per request, as OpenAI
MAX_STOP_CHARS = 256  # characters per stop string
MAX_SEED = 2**63 - 1
# How often a non-streaming request checks that its client is still there; uvicorn notices a
# closed connection only after the first check resumes reading it, so leaving takes two checks.
DISCONNECT_POLL_S = 0.25
MAX_ERROR_CHARS = 200  # an exception's message as a client sees it (the log has the traceback)
MAX_RESTARTS = 10  # crashes of the worker loop recovered from before the server gives up
