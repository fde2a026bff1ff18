//! The conversations the benchmarks tokenize (shared by the criterion bench
//! and the report example): realistic agentic turns, deterministic.

#![allow(dead_code)]

/// A chat body (`/tokenize` shape) of `turns` turns.
pub fn messages(turns: usize) -> Vec<serde_json::Value> {
    let mut msgs = vec![
        serde_json::json!({"role": "system", "content": "You are a coding agent. Use the tools to read and edit files, run tests, and explain what you changed."}),
    ];
    for t in 0..turns {
        msgs.push(serde_json::json!({"role": "user", "content": user_turn(t)}));
        msgs.push(serde_json::json!({"role": "assistant", "content": assistant_turn(t)}));
    }
    msgs
}

/// A user turn: a request and a pasted file.
pub fn user_turn(t: usize) -> String {
    let mut s = format!(
        "Step {t}: please look at src/module_{t}.rs and fix the failing test `test_case_{t}`.\n\n```rust\n"
    );
    for line in 0..18 {
        s.push_str(&format!("    let value_{line} = compute(input_{t}, {line}) + offset; // keeps the prefix cache warm\n"));
    }
    s.push_str("```\nThe error was: assertion failed at line 42, expected 17 but got 23.\n");
    s
}

/// An assistant turn.
pub fn assistant_turn(t: usize) -> String {
    format!(
        "I read module_{t}. The bug is an off-by-one in the loop bound: the range should end at `len - 1`.\n\
         I changed it and re-ran the tests; all {} tests pass now. Next I will check the callers of `compute` \
         for the same pattern, since three of them copy this loop.\n",
        100 + t
    )
}

/// The body for `messages`.
pub fn body(messages: &[serde_json::Value]) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({ "messages": messages })).unwrap_or_default()
}
