//! The members of `ResponsesRequest`'s input item union, as the openai
//! SDK declares them (TypedDicts and models), written out for the item
//! types the conversion reads; the other types by the fields they require.

/// What a field holds.
#[derive(Clone, Copy)]
pub(super) enum Ty {
    Str,
    Bool,
    Int,
    Float,
    /// One of these strings.
    Lit(&'static [&'static str]),
    /// A list whose every element is the type.
    List(&'static Ty),
    /// An `Iterable[…]`: any iterable (list, string, object) to pydantic,
    /// which checks the elements only as they are read (those the chat
    /// parser reads: `read_later`).
    Iterable,
    /// Anything (not checked here).
    Any,
    /// Any of these.
    Union(&'static [Ty]),
    /// A TypedDict or model: these fields, any others.
    Obj(&'static [Field]),
}

/// Whether a field must be there, and may be `null`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Need {
    /// Present, not `null`.
    Req,
    /// Absent, or present and not `null`.
    Opt,
    /// Absent, `null`, or the type.
    Null,
    /// Present: `null` or the type.
    ReqNull,
}

#[derive(Clone, Copy)]
pub(super) struct Field {
    pub(super) key: &'static str,
    pub(super) ty: Ty,
    pub(super) need: Need,
}

const fn f(key: &'static str, ty: Ty, need: Need) -> Field {
    Field { key, ty, need }
}

use Need::{Null, Opt, Req, ReqNull};
use Ty::{Any, Bool, Float, Int, Iterable, Lit, Obj, Str, Union};

pub(super) const STATUS: Ty = Lit(&["in_progress", "completed", "incomplete"]);
pub(super) const PHASE: Ty = Lit(&["commentary", "final_answer"]);
pub(super) const IMAGE_DETAIL: Ty = Lit(&["low", "high", "auto", "original"]);
pub(super) const FILE_DETAIL: Ty = Lit(&["auto", "low", "high"]);

pub(super) static BREAKPOINT: [Field; 2] = [
    f("mode", Lit(&["explicit"]), Req),
    f("ttl", Lit(&["30m", "12h"]), Opt),
];
pub(super) const INPUT_TEXT: Ty = Obj(&[
    f("text", Str, Req),
    f("type", Lit(&["input_text"]), Req),
    f("prompt_cache_breakpoint", Obj(&BREAKPOINT), Opt),
]);
pub(super) const INPUT_FILE: Ty = Obj(&[
    f("type", Lit(&["input_file"]), Req),
    f("detail", FILE_DETAIL, Opt),
    f("file_data", Str, Opt),
    f("file_id", Str, Null),
    f("file_url", Str, Opt),
    f("filename", Str, Opt),
    f("prompt_cache_breakpoint", Obj(&BREAKPOINT), Opt),
]);
static BREAKPOINT_MODEL: [Field; 2] = [
    f("mode", Lit(&["explicit"]), Req),
    f("ttl", Lit(&["30m", "12h"]), Null),
];
pub(super) static CALLER: [Ty; 2] = [
    Obj(&[f("type", Lit(&["direct"]), Req)]),
    Obj(&[f("caller_id", Str, Req), f("type", Lit(&["program"]), Req)]),
];

/// Message content parts (`ResponseInputContentParam`): vLLM gives an
/// image without `detail` the default `"auto"`.
pub(super) static MESSAGE_PART: Ty = Union(&[
    INPUT_TEXT,
    Obj(&[
        f("detail", IMAGE_DETAIL, Opt),
        f("type", Lit(&["input_image"]), Req),
        f("file_id", Str, Null),
        f("image_url", Str, Null),
        f("prompt_cache_breakpoint", Obj(&BREAKPOINT), Opt),
    ]),
    INPUT_FILE,
]);

/// `ResponseInputContentParam` as the chat parser reads a custom tool's
/// output: an image needs its `detail`.
pub(super) static INPUT_PART: Ty = Union(&[
    INPUT_TEXT,
    Obj(&[
        f("detail", IMAGE_DETAIL, Req),
        f("type", Lit(&["input_image"]), Req),
        f("file_id", Str, Null),
        f("image_url", Str, Null),
        f("prompt_cache_breakpoint", Obj(&BREAKPOINT), Opt),
    ]),
    INPUT_FILE,
]);

/// Function output parts (`ResponseFunctionCallOutputItemParam`; the output
/// model takes no item this TypedDict refuses).
pub(super) static OUTPUT_PART: Ty = Union(&[
    Obj(&[
        f("text", Str, Req),
        f("type", Lit(&["input_text"]), Req),
        f("prompt_cache_breakpoint", Obj(&BREAKPOINT), Null),
    ]),
    Obj(&[
        f("type", Lit(&["input_image"]), Req),
        f("detail", IMAGE_DETAIL, Null),
        f("file_id", Str, Null),
        f("image_url", Str, Null),
        f("prompt_cache_breakpoint", Obj(&BREAKPOINT), Null),
    ]),
    Obj(&[
        f("type", Lit(&["input_file"]), Req),
        f("detail", FILE_DETAIL, Opt),
        f("file_data", Str, Null),
        f("file_id", Str, Null),
        f("file_url", Str, Null),
        f("filename", Str, Null),
        f("prompt_cache_breakpoint", Obj(&BREAKPOINT), Null),
    ]),
]);

/// The output models' parts (function and custom tool outputs): an image
/// needs its `detail`.
pub(super) static MODEL_OUTPUT_PART: Ty = Union(&[
    Obj(&[
        f("text", Str, Req),
        f("type", Lit(&["input_text"]), Req),
        f("prompt_cache_breakpoint", Obj(&BREAKPOINT_MODEL), Null),
    ]),
    Obj(&[
        f("detail", IMAGE_DETAIL, Req),
        f("type", Lit(&["input_image"]), Req),
        f("file_id", Str, Null),
        f("image_url", Str, Null),
        f("prompt_cache_breakpoint", Obj(&BREAKPOINT_MODEL), Null),
    ]),
    Obj(&[
        f("type", Lit(&["input_file"]), Req),
        f("detail", FILE_DETAIL, Null),
        f("file_data", Str, Null),
        f("file_id", Str, Null),
        f("file_url", Str, Null),
        f("filename", Str, Null),
        f("prompt_cache_breakpoint", Obj(&BREAKPOINT_MODEL), Null),
    ]),
]);

pub(super) static EASY_CONTENT: Ty = Union(&[Str, Ty::List(&MESSAGE_PART)]);
pub(super) static EASY_MESSAGE: [Field; 4] = [
    f("content", EASY_CONTENT, Req),
    f(
        "role",
        Lit(&["user", "assistant", "system", "developer"]),
        Req,
    ),
    f("phase", PHASE, Null),
    f("type", Lit(&["message"]), Opt),
];
pub(super) static INPUT_MESSAGE: [Field; 4] = [
    f("content", Ty::List(&MESSAGE_PART), Req),
    f("role", Lit(&["user", "system", "developer"]), Req),
    f("status", STATUS, Opt),
    f("type", Lit(&["message"]), Opt),
];
pub(super) static ITEM_REFERENCE: [Field; 2] =
    [f("id", Str, Req), f("type", Lit(&["item_reference"]), Null)];

pub(super) static ANNOTATION: Ty = Union(&[
    Obj(&[
        f("file_id", Str, Req),
        f("filename", Str, Req),
        f("index", Int, Req),
        f("type", Lit(&["file_citation"]), Req),
    ]),
    Obj(&[
        f("end_index", Int, Req),
        f("start_index", Int, Req),
        f("title", Str, Req),
        f("type", Lit(&["url_citation"]), Req),
        f("url", Str, Req),
    ]),
    Obj(&[
        f("container_id", Str, Req),
        f("end_index", Int, Req),
        f("file_id", Str, Req),
        f("filename", Str, Req),
        f("start_index", Int, Req),
        f("type", Lit(&["container_file_citation"]), Req),
    ]),
    Obj(&[
        f("file_id", Str, Req),
        f("index", Int, Req),
        f("type", Lit(&["file_path"]), Req),
    ]),
]);
pub(super) static TOP_LOGPROB: [Field; 3] = [
    f("token", Str, Req),
    f("bytes", Ty::List(&Int), Req),
    f("logprob", Float, Req),
];
pub(super) static LOGPROB: [Field; 4] = [
    f("token", Str, Req),
    f("bytes", Ty::List(&Int), Req),
    f("logprob", Float, Req),
    f("top_logprobs", Ty::List(&Obj(&TOP_LOGPROB)), Req),
];
pub(super) static REFUSAL: [Field; 2] = [f("refusal", Str, Req), f("type", Lit(&["refusal"]), Req)];
/// `ResponseOutputMessageParam`'s parts, read by the chat parser.
pub(super) static OUTPUT_CONTENT_PARAM: Ty = Union(&[
    Obj(&[
        f("annotations", Iterable, Req),
        f("text", Str, Req),
        f("type", Lit(&["output_text"]), Req),
        f("logprobs", Iterable, Opt),
    ]),
    Obj(&REFUSAL),
]);
/// The output message model (`ResponseOutputMessage`), as vLLM fills in
/// an assistant message with list content before pydantic sees it (which
/// is the only message the model takes).
pub(super) static OUTPUT_MESSAGE: [Field; 6] = [
    f("id", Str, Opt),
    f(
        "content",
        Ty::List(&Union(&[
            Obj(&[
                f("annotations", Ty::List(&ANNOTATION), Opt),
                f("text", Str, Req),
                f("type", Lit(&["output_text"]), Req),
                f("logprobs", Ty::List(&Obj(&LOGPROB)), Null),
            ]),
            Obj(&REFUSAL),
        ])),
        Req,
    ),
    f("role", Lit(&["assistant"]), Req),
    f("status", STATUS, Opt),
    f("type", Lit(&["message"]), Req),
    f("phase", PHASE, Null),
];
pub(super) static OUTPUT_MESSAGE_PARAM: [Field; 6] = [
    f("id", Str, Req),
    f("content", Iterable, Req),
    f("role", Lit(&["assistant"]), Req),
    f("status", STATUS, Req),
    f("type", Lit(&["message"]), Req),
    f("phase", PHASE, Null),
];

pub(super) static FUNCTION_CALL: [Field; 9] = [
    f("arguments", Str, Req),
    f("call_id", Str, Req),
    f("name", Str, Req),
    f("type", Lit(&["function_call"]), Req),
    f("id", Str, Null),
    f("async", Bool, Null),
    f("caller", Union(&CALLER), Null),
    f("namespace", Str, Null),
    f("status", STATUS, Null),
];
pub(super) static FUNCTION_CALL_OUTPUT: [Field; 8] = [
    f("output", Union(&[Str, Ty::List(&OUTPUT_PART)]), Req),
    f("type", Lit(&["function_call_output"]), Req),
    f("id", Str, Null),
    f("call_id", Str, Null),
    f("caller", Union(&CALLER), Null),
    f("name", Str, Null),
    f("namespace", Str, Null),
    f("status", STATUS, Null),
];
/// The reasoning model (the one the conversion reads); vLLM supplies a
/// missing `id`.
/// The function output model, which the conversion hands the chat parser
/// with its parts still models.
pub(super) static FUNCTION_CALL_OUTPUT_ITEM: [Field; 9] = [
    f("id", Str, Req),
    f("output", Union(&[Str, Ty::List(&MODEL_OUTPUT_PART)]), Req),
    f("status", STATUS, Req),
    f("type", Lit(&["function_call_output"]), Req),
    f("call_id", Str, Null),
    f("caller", Union(&CALLER), Null),
    f("created_by", Str, Null),
    f("name", Str, Null),
    f("namespace", Str, Null),
];
/// The reasoning model (the one the conversion reads); vLLM supplies a
/// missing `id`.
pub(super) static REASONING: [Field; 6] = [
    f("id", Str, Opt),
    f(
        "summary",
        Ty::List(&Obj(&[
            f("text", Str, Req),
            f("type", Lit(&["summary_text"]), Req),
        ])),
        Req,
    ),
    f("type", Lit(&["reasoning"]), Req),
    f("content", Ty::List(&REASONING_TEXT), Null),
    f("encrypted_content", Str, Null),
    f("status", STATUS, Null),
];
pub(super) static CUSTOM_TOOL_CALL: [Field; 8] = [
    f("call_id", Str, Req),
    f("input", Str, Req),
    f("name", Str, Req),
    f("type", Lit(&["custom_tool_call"]), Req),
    f("id", Str, Null),
    f("async", Bool, Null),
    f("caller", Union(&CALLER), Null),
    f("namespace", Str, Null),
];
pub(super) static CUSTOM_TOOL_CALL_OUTPUT: [Field; 5] = [
    f("call_id", Str, Req),
    f("output", Union(&[Str, Iterable]), Req),
    f("type", Lit(&["custom_tool_call_output"]), Req),
    f("id", Str, Opt),
    f("caller", Union(&CALLER), Null),
];
pub(super) static CUSTOM_TOOL_CALL_OUTPUT_ITEM: [Field; 7] = [
    f("call_id", Str, Req),
    f("output", Union(&[Str, Ty::List(&MODEL_OUTPUT_PART)]), Req),
    f("type", Lit(&["custom_tool_call_output"]), Req),
    f("id", Str, Req),
    f("caller", Union(&CALLER), Null),
    f("status", STATUS, Req),
    f("created_by", Str, Null),
];

pub(super) static REASONING_TEXT: Ty = Obj(&[
    f("text", Str, Req),
    f("type", Lit(&["reasoning_text"]), Req),
]);
/// The reasoning TypedDict, whose lists pydantic reads late (the
/// conversion hands a reasoning item that is not the model on whole if it
/// has a `role`, and refuses it if not).
pub(super) static REASONING_PARAM: [Field; 6] = [
    f("id", Str, Opt),
    f("summary", Iterable, Req),
    f("type", Lit(&["reasoning"]), Req),
    f("content", Iterable, Opt),
    f("encrypted_content", Str, Null),
    f("status", STATUS, Opt),
];

/// `additional_tools`, whose `role` makes it a chat message when it is the
/// TypedDict (a developer message); the model (an `id`, any role) is one
/// the conversion refuses. The tools themselves are not checked.
pub(super) static ADDITIONAL_TOOLS: [Field; 4] = [
    f("role", Lit(&["developer"]), Req),
    f("tools", Iterable, Req),
    f("type", Lit(&["additional_tools"]), Req),
    f("id", Str, Null),
];
pub(super) static ADDITIONAL_TOOLS_ITEM: [Field; 4] = [
    f("id", Str, Req),
    f(
        "role",
        Lit(&[
            "unknown",
            "user",
            "assistant",
            "system",
            "critic",
            "discriminator",
            "developer",
            "tool",
        ]),
        Req,
    ),
    f("tools", Ty::List(&Any), Req),
    f("type", Lit(&["additional_tools"]), Req),
];

const CALL_STATUS: Ty = STATUS;
const SEARCH_STATUS: Ty = Lit(&[
    "in_progress",
    "searching",
    "completed",
    "incomplete",
    "failed",
]);

/// The SDK's other item types: the fields their TypedDict requires (a
/// dict the conversion passes on as a chat message when it has a `role`),
/// and, where the model requires less, the model's (an item the conversion
/// refuses). Only these fields are checked, and only their outer types.
pub(super) static OTHER_ITEMS: [(&str, &[Field], &[Field]); 23] = [
    (
        "apply_patch_call",
        &[
            f("call_id", Str, Req),
            f("operation", Any, Req),
            f("status", Lit(&["in_progress", "completed"]), Req),
        ],
        &[],
    ),
    (
        "apply_patch_call_output",
        &[
            f("call_id", Str, Req),
            f("status", Lit(&["completed", "failed"]), Req),
        ],
        &[],
    ),
    (
        "code_interpreter_call",
        &[
            f("id", Str, Req),
            f("code", Str, ReqNull),
            f("container_id", Str, Req),
            f("outputs", Iterable, ReqNull),
            f("status", INTERPRETER_STATUS, Req),
        ],
        &[
            f("id", Str, Req),
            f("container_id", Str, Req),
            f("status", INTERPRETER_STATUS, Req),
        ],
    ),
    ("compaction", &[f("encrypted_content", Str, Req)], &[]),
    ("compaction_trigger", &[], &[]),
    (
        "computer_call",
        &[
            f("id", Str, Req),
            f("call_id", Str, Req),
            f("pending_safety_checks", Iterable, Req),
            f("status", CALL_STATUS, Req),
        ],
        &[],
    ),
    (
        "computer_call_output",
        &[f("call_id", Str, Req), f("output", Any, Req)],
        &[],
    ),
    ("configuration_update", &[], &[]),
    (
        "file_search_call",
        &[
            f("id", Str, Req),
            f("queries", Ty::List(&Str), Req),
            f("status", SEARCH_STATUS, Req),
        ],
        &[],
    ),
    (
        "image_generation_call",
        &[
            f("id", Str, Req),
            f("result", Str, ReqNull),
            f("status", IMAGE_STATUS, Req),
        ],
        &[f("id", Str, Req), f("status", IMAGE_STATUS, Req)],
    ),
    (
        "local_shell_call",
        &[
            f("id", Str, Req),
            f("action", Any, Req),
            f("call_id", Str, Req),
            f("status", CALL_STATUS, Req),
        ],
        &[],
    ),
    (
        "local_shell_call_output",
        &[f("id", Str, Req), f("output", Str, Req)],
        &[],
    ),
    ("mcp_approval_request", &MCP_CALL, &[]),
    (
        "mcp_approval_response",
        &[f("approval_request_id", Str, Req), f("approve", Bool, Req)],
        &[],
    ),
    ("mcp_call", &MCP_CALL, &[]),
    (
        "mcp_list_tools",
        &[
            f("id", Str, Req),
            f("server_label", Str, Req),
            f("tools", Iterable, Req),
        ],
        &[],
    ),
    (
        "program",
        &[
            f("id", Str, Req),
            f("call_id", Str, Req),
            f("code", Str, Req),
            f("fingerprint", Str, Req),
        ],
        &[],
    ),
    (
        "program_output",
        &[
            f("id", Str, Req),
            f("call_id", Str, Req),
            f("result", Str, Req),
            f("status", Lit(&["completed", "incomplete"]), Req),
        ],
        &[],
    ),
    (
        "shell_call",
        &[f("action", Any, Req), f("call_id", Str, Req)],
        &[],
    ),
    (
        "shell_call_output",
        &[f("call_id", Str, Req), f("output", Iterable, Req)],
        &[],
    ),
    ("tool_search_call", &[f("arguments", Any, ReqNull)], &[]),
    ("tool_search_output", &[f("tools", Iterable, Req)], &[]),
    (
        "web_search_call",
        &[
            f("id", Str, Req),
            f("action", Any, Req),
            f("status", SEARCH_STATUS, Req),
        ],
        &[],
    ),
];

const INTERPRETER_STATUS: Ty = Lit(&[
    "in_progress",
    "completed",
    "incomplete",
    "interpreting",
    "failed",
]);
const IMAGE_STATUS: Ty = Lit(&["in_progress", "completed", "generating", "failed"]);
static MCP_CALL: [Field; 4] = [
    f("id", Str, Req),
    f("arguments", Str, Req),
    f("name", Str, Req),
    f("server_label", Str, Req),
];
