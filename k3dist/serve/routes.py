"""Every route's declared request body, by path (schema.py's, responses_schema.py's): what the tests hold the page,
the fuzzer and the agent frameworks' bodies to."""

from .responses_schema import ResponsesRequest
from .schema import ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest

ROUTES = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatRequest,
    "/v1/responses": ResponsesRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}
