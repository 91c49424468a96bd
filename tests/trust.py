"""One set of service secrets for the tests that build workers and learners directly (fresh each session)."""

from rlens.service.common.security import FeedbackTokens, PolicySigner, generate_secrets

SECRETS = generate_secrets()
SIGNER = PolicySigner(SECRETS["RLENS_POLICY_SIGNING_KEY"])
VERIFIER = SIGNER.verifier()
TOKENS = FeedbackTokens(SECRETS["RLENS_FEEDBACK_SECRET"])


def token(query_id: str, stream: str = "s") -> str:
    """The feedback token of ``query_id`` asked on ``stream``."""
    return TOKENS.token(query_id, stream)
