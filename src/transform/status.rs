//! Status lines: the lines of a tool result or an observation that report
//! what an action did. Context dedup never removes them (a removed run ends
//! before one), so the model always reads the outcome of its newest action
//! where it happened, even when the output around it repeats.
//!
//! Recognised by kind, never by one agent's strings:
//!
//! - exit and return codes in any form (`exit code: 1`, `Exit code 1`,
//!   `<returncode>1</returncode>`, `Process exited with code 0`,
//!   `[Command finished with exit code 0]`, `exit status 2`, `rc=2`,
//!   `exited 1`, `status: failed`), signals by name, a process's end
//!   (`OOMKilled`), an HTTP status line (`HTTP/1.1 503 Service
//!   Unavailable`), a system error's name (`ECONNREFUSED`);
//! - the first and the last line of a traceback (`Traceback (most recent
//!   call last):` and the exception line after its frames), panics;
//! - error, warning and failure heads (`error:`, `error[E0425]:`,
//!   `Error: …`, `ERROR …`, `warning:`, `FAILED …`, `FAIL`, `fatal:`,
//!   `CRITICAL: …`, a label in capitals (`ACTION REQUIRED: …`),
//!   `npm ERR!`, pytest's `E   …`, an exception's `ValueError: …`), and
//!   tags that carry them (`<error>`, `<warning>`, `<tool_use_error>`);
//! - sentences that report an outcome (`File updated. Please review…`,
//!   `Your command ran successfully and did not produce any output.`,
//!   `No such file or directory`, `3 failed, 2 passed`, `0 passing, 3
//!   failing`, `12 examples, 2 failures`, TAP's `not ok 3 - …`);
//! - denials: permission, sandbox, approval (`Permission denied`,
//!   `The user denied this operation.`, `… rejected …`);
//! - timings (`Wall time: 0.5 seconds`, `real 0m0.12s`, `… in 0.31s`,
//!   `took 3 ms`);
//! - the harness's remarks and state lines: a whole line in brackets or
//!   parentheses that reads as a sentence (`[Current working directory:
//!   /workspace]`, `(Open file: /repo/x.py)`, `[File: a.py (120 lines
//!   total)]`), and lines naming the working directory.
//!
//! Over-keeping costs a few bytes; under-keeping costs the agent its turn,
//! so where a form is unclear it counts as status.

/// Tags whose content is the harness speaking to the model (matched
/// inside a tag's name: `system-reminder`, `response_example`).
const GUIDANCE_TAGS: &[&str] = &[
    "reminder",
    "example",
    "instruction",
    "warning",
    "important",
    "note",
    "guidance",
    "rules",
];
/// Lines of such a tag kept at most (one never closed is not a licence to
/// keep the whole result).
const GUIDANCE_LINES: usize = 64;

/// Which of `lines` (one text, in order) are status lines.
pub fn mark(lines: &[&str]) -> Vec<bool> {
    mark_with(lines, |_, l| is_status(l), |_| false)
}

/// [`mark`], with the line-by-line judgement `line_status(q, line)` given
/// by the caller (one that remembers lines it has judged, or skips lines
/// that cannot matter to it); the rules that need the lines around a line
/// (a traceback's last line, a reminder block) are applied here.
/// `transparent` lines (visor's own notes, in a text it rewrote) are
/// passed over by those rules, so a second pass reads a traceback whose
/// frames became a note as the first pass read it.
pub fn mark_with(
    lines: &[&str],
    mut line_status: impl FnMut(usize, &str) -> bool,
    transparent: impl Fn(&str) -> bool,
) -> Vec<bool> {
    let mut out: Vec<bool> = lines
        .iter()
        .enumerate()
        .map(|(q, l)| line_status(q, l))
        .collect();
    // What the harness says to the model inside a result, in a tag of its
    // own (`<system-reminder>`, `<warning>`, `<response_example>`,
    // `<instructions>`, … up to its closing tag, [`GUIDANCE_LINES`] at
    // most), is an instruction or a worked example: every line stays.
    let mut open: Option<(String, usize)> = None;
    for (q, l) in lines.iter().enumerate() {
        let t = l.trim();
        if open.is_none() && t.starts_with('<') && !t.starts_with("</") {
            let name = tag_name(t);
            if GUIDANCE_TAGS.iter().any(|g| name.contains(g)) {
                open = Some((name, q));
            }
        }
        if let Some((name, start)) = &open {
            out[q] = true;
            let closes = t.contains(&format!("</{name}"));
            if closes || q - start + 1 >= GUIDANCE_LINES {
                open = None;
            }
        }
    }
    // A traceback's last line: the first line after its header that is not
    // a frame (indented, or `File …`), whatever the exception is called.
    let mut in_trace = false;
    for (q, l) in lines.iter().enumerate() {
        let t = l.trim_start();
        if t.starts_with("Traceback (most recent call last)") {
            in_trace = true;
            continue;
        }
        if !in_trace || t.is_empty() || transparent(l) {
            continue;
        }
        let frame = l.starts_with(char::is_whitespace) || t.starts_with("File \"");
        if !frame {
            out[q] = true;
            in_trace = false;
        }
    }
    out
}

/// Whether one line, on its own, reports what an action did.
pub fn is_status(line: &str) -> bool {
    let t = line.trim();
    if t.is_empty() || t.len() > 400 || numbered(t) {
        // A status line is short; a 400-byte line is output, and so is a
        // numbered line of a file view.
        return false;
    }
    let lower = t.to_ascii_lowercase();
    // A list's mark does not make a line less of a head (`- E999
    // SyntaxError: …`, `* error: …`).
    let bare = t.trim_start_matches(['-', '*', '•', '>', ' ']);
    code(&lower)
        || keyed_code(&lower)
        || ended(&lower)
        || http_status(&lower)
        || label(bare)
        || verdict(t)
        || traceback_head(bare)
        || head(bare)
        || named_error(t)
        || diagnostic(bare)
        || assertion_value(bare)
        || addressed(bare)
        || tag(&lower)
        || denial(&lower)
        || timing(&lower)
        || remark(t)
        || state(&lower)
        || truncation(&lower)
        || key_value(t)
        || outcome(t, &lower)
}

/// A numbered line of a file view (`281:        raise …`, `     3→import
/// os`, `    12\tx = 1`): the file's text, whatever it says.
fn numbered(t: &str) -> bool {
    let digits = t.bytes().take_while(u8::is_ascii_digit).count();
    if digits == 0 {
        return false;
    }
    let rest = &t[digits..];
    rest.starts_with('\t')
        || rest.starts_with('→')
        || rest.starts_with('|')
        || (rest.starts_with(':') && rest[1..].starts_with(char::is_whitespace))
        || (rest.starts_with(':') && rest.len() == 1)
}

/// The values of a failed assertion (`left: …`, `right: …`, `Expected:
/// …`, `Received: …`, `got …, want …`).
fn assertion_value(t: &str) -> bool {
    let lower = t.to_ascii_lowercase();
    [
        "left:",
        "right:",
        "expected:",
        "actual:",
        "received:",
        "got:",
        "want:",
        "diff:",
    ]
    .iter()
    .any(|p| lower.starts_with(p))
        || (lower.contains("got ") && lower.contains("want "))
}

/// A sentence the harness addresses to the model: guidance, a rule, a
/// retry advice (`Please try a different command…`, `Did you mean to
/// match some of these lines?`, `The SEARCH section must exactly match…`,
/// `IMPORTANT: …`, `DO NOT re-run the same failed edit command.`).
fn addressed(t: &str) -> bool {
    let t = t.trim_start_matches(['#', ' ']);
    let prose = strip_code(t);
    let sentence = t.starts_with(|c: char| c.is_uppercase()) && words_of(&prose) >= 4;
    if !sentence || code_like(&prose) {
        return false;
    }
    let lower = prose.to_ascii_lowercase();
    const WORDS: &[&str] = &[
        "you",
        "your",
        "please",
        "must",
        "never",
        "always",
        "important",
        "note",
        "should",
        "try",
        "retry",
        "don't",
        "do not",
        "make sure",
        "ensure",
        "avoid",
        "remember",
        "forget",
        "required",
        "recommended",
        "consider",
    ];
    lower
        .split(|c: char| !(c.is_alphanumeric() || c == '\''))
        .any(|w| WORDS.contains(&w))
        || lower.contains("do not")
        || lower.contains("make sure")
}

/// The line without its `backtick` spans: code quoted in prose.
fn strip_code(t: &str) -> String {
    t.split('`').step_by(2).collect::<Vec<_>>().join(" ")
}

/// Whether a line (its quoted code taken out) reads as code.
fn code_like(t: &str) -> bool {
    t.contains(['(', ')', '{', '}', ';', '='])
        && !(t.ends_with('.') || t.ends_with('?') || t.ends_with('!'))
}

fn words_of(t: &str) -> usize {
    t.split_whitespace().count()
}

/// An error or exception named before a colon anywhere in the line
/// (`- E999 SyntaxError: unmatched ')'`, `… raised KeyError: 'x'`), not
/// a call (`raise ValueError(msg)`).
fn named_error(t: &str) -> bool {
    t.match_indices(':').any(|(i, _)| {
        let word_start = t[..i]
            .char_indices()
            .rfind(|(_, c)| !(c.is_ascii_alphanumeric() || *c == '_'))
            .map_or(0, |(k, c)| k + c.len_utf8());
        let word = &t[word_start..i];
        exception_name(word)
    }) || t
        .rsplit(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .next()
        .is_some_and(|last| exception_name(last) && t.contains(": "))
}

/// `ValueError`, `DeprecationWarning`, `IOException`.
fn exception_name(word: &str) -> bool {
    word.starts_with(|c: char| c.is_ascii_uppercase())
        && ["Error", "Exception", "Warning"]
            .iter()
            .any(|s| word.len() > s.len() && word.ends_with(s))
}

/// A compiler's or linter's diagnostic: `path:12:5: message`, `path:12:
/// error: …`, `line 12 col 5: F821 …`.
fn diagnostic(t: &str) -> bool {
    if let Some(rest) = t.strip_prefix("line ") {
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if digits > 0 && rest[digits..].trim_start().starts_with("col") {
            return true;
        }
    }
    // `:<line>:<col>: ` after a path with no spaces.
    let Some(first_space) = t.find(' ') else {
        return false;
    };
    let location = &t[..first_space];
    let Some(location) = location.strip_suffix(':') else {
        return false;
    };
    let mut parts = location.rsplit(':');
    let (Some(col), Some(line)) = (parts.next(), parts.next()) else {
        return false;
    };
    let number = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    // `x_test.go:57: attempts = 3, want 1`: a file with an extension, its
    // line, one space and the message.
    let after = &t[first_space + 1..];
    if number(col)
        && line.rsplit('/').next().is_some_and(|f| f.contains('.'))
        && !after.starts_with(char::is_whitespace)
        && !after.is_empty()
    {
        return true;
    }
    let severity = ["error", "warning", "note", "fatal"].iter().any(|w| {
        t[first_space..]
            .trim_start()
            .to_ascii_lowercase()
            .starts_with(w)
    });
    parts.next().is_some_and(|path| !path.is_empty())
        && ((number(line) && number(col)) || (number(col) && severity))
}

/// A verdict printed alone on its line (`OK`, `PASS`, `FAIL`, `Killed`),
/// or the label a harness puts before the output (`Output:`,
/// `OBSERVATION:`, `[execute_command for 'ls'] Result:`).
fn verdict(t: &str) -> bool {
    const ALONE: &[&str] = &[
        "OK",
        "PASS",
        "PASSED",
        "FAIL",
        "FAILED",
        "ERROR",
        "Killed",
        "Terminated",
        "Aborted",
        "Done",
        "Output:",
        "OBSERVATION:",
        "Observation:",
        "STDOUT:",
        "STDERR:",
        "stdout:",
        "stderr:",
    ];
    ALONE.contains(&t) || t.ends_with("] Result:") || t.starts_with("EXECUTION RESULT")
}

/// A note that output was cut: what is missing is said there
/// (`<elided_chars>`, `12345 characters elided`, `[... output truncated
/// ...]`, `NOTE: Output was 812 lines, showing only the last 100 lines.`).
fn truncation(lower: &str) -> bool {
    const FORMS: &[&str] = &[
        "truncated",
        "elided",
        "clipped",
        "showing only",
        "lines dropped",
        "earlier lines",
        "output exceeded",
        "output saved to",
        "output was",
    ];
    FORMS.iter().any(|f| lower.contains(f))
}

/// A short header of the harness's: a capitalised key of a few words and
/// one value (`Chunk ID: 5f2c1a`, `Original token count: 18234`,
/// `Total output lines: 4812`).
fn key_value(t: &str) -> bool {
    let Some((key, value)) = t.split_once(": ") else {
        return false;
    };
    t.len() <= 80
        && key.starts_with(|c: char| c.is_ascii_uppercase())
        && key.split(' ').count() <= 4
        && key.chars().all(|c| c.is_ascii_alphabetic() || c == ' ')
        && !value.is_empty()
        && !value.contains(char::is_whitespace)
}

/// An exit or return code, or a signal, in any form.
fn code(lower: &str) -> bool {
    const FORMS: &[&str] = &[
        "exit code",
        "exit status",
        "exit_code",
        "exitcode",
        "exit value",
        "returncode",
        "return code",
        "return_code",
        "exited with",
        "process exited",
        "exited (",
        "killed by signal",
        "terminated by signal",
        "status code",
    ];
    if FORMS.iter().any(|f| lower.contains(f)) {
        return true;
    }
    // `Exit 1` (a shell's job line), `exit 2`.
    lower.match_indices("exit ").any(|(i, _)| {
        let before = lower[..i].chars().next_back();
        before.is_none_or(|c| !c.is_alphanumeric() && c != '_' && c != '.')
            && lower[i + 5..].starts_with(|c: char| c.is_ascii_digit() || c == '-')
    })
}

/// A code or a status given as a key and its value (`rc=2`, `rc: 2`,
/// `exit=1`, `exited 1`, `code=1`, `status: 1`, `status=failed`,
/// `result: error`), not code that reads one (`status = self.status`,
/// `if code == 1`). A number after `status`, `code`, `state`, `result` or
/// `outcome` counts only at the line's start: among other fields it is a
/// record's (`… path=/ status=200`), not an action's outcome.
fn keyed_code(lower: &str) -> bool {
    const KEYS: &[&str] = &[
        "rc", "exit", "exited", "code", "status", "state", "result", "outcome", "ret", "retval",
    ];
    const VALUES: &[&str] = &[
        "ok",
        "success",
        "succeeded",
        "passed",
        "pass",
        "fail",
        "failed",
        "failure",
        "error",
        "errored",
        "killed",
        "crashed",
        "aborted",
        "timeout",
        "timedout",
        "cancelled",
        "canceled",
        "denied",
        "rejected",
        "completed",
        "done",
        "skipped",
    ];
    if !lower.contains(['=', ':']) && !lower.contains("exit") {
        return false;
    }
    let b = lower.as_bytes();
    KEYS.iter().any(|key| {
        lower.match_indices(key).any(|(i, _)| {
            let before = i.checked_sub(1).map(|k| b[k]);
            if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'.') {
                return false;
            }
            let rest = &lower[i + key.len()..];
            // `key=`, `key:` or (`exit`, `exited`) `key N`.
            let value = match rest.as_bytes().first() {
                Some(b'=') if !rest[1..].starts_with('=') => &rest[1..],
                Some(b':') => &rest[1..],
                Some(b' ') if key.starts_with("exit") => rest,
                _ => return false,
            };
            let value = value.trim_start_matches([' ', '"', '\'']);
            let number = value.strip_prefix('-').unwrap_or(value);
            let digits = number.bytes().take_while(u8::is_ascii_digit).count();
            let word_end = value
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(value.len());
            let coded = matches!(*key, "rc" | "exit" | "exited" | "ret" | "retval");
            let leading = lower[..i].trim().is_empty();
            (digits > 0
                && (coded || leading)
                && !number[digits..].starts_with(|c: char| c.is_alphanumeric() || c == '.'))
                || (!key.starts_with("exit") && VALUES.contains(&&value[..word_end]))
        })
    })
}

/// How a process ended, by name: a signal (`SIGKILL`), `OOMKilled`, a
/// system error (`ECONNREFUSED`, `ETIMEDOUT`, `ENOSPC`).
fn ended(lower: &str) -> bool {
    const NAMES: &[&str] = &[
        "sigkill",
        "sigterm",
        "sigsegv",
        "sigabrt",
        "sigbus",
        "sigint",
        "sighup",
        "sigpipe",
        "sigill",
        "sigfpe",
        "sigquit",
        "oomkilled",
        "crashloopbackoff",
        "enoent",
        "eacces",
        "eperm",
        "eexist",
        "enotdir",
        "eisdir",
        "einval",
        "emfile",
        "enfile",
        "enospc",
        "erofs",
        "epipe",
        "eagain",
        "ebusy",
        "enomem",
        "enotempty",
        "eloop",
        "enametoolong",
        "ebadf",
        "eintr",
        "eio",
        "enxio",
        "e2big",
        "enoexec",
        "etxtbsy",
        "enotconn",
        "econnrefused",
        "econnreset",
        "econnaborted",
        "etimedout",
        "ehostunreach",
        "enetunreach",
        "enetdown",
        "eaddrinuse",
        "eaddrnotavail",
        "enotfound",
        "eai_again",
        "eproto",
        "ecanceled",
        "enotsup",
        "eopnotsupp",
        "edquot",
        "esrch",
    ];
    // (Each name begins with one of four letters: most words are not
    // looked up.)
    words(lower).any(|w| w.starts_with(['s', 'e', 'o', 'c']) && NAMES.contains(&w))
}

/// An HTTP status line (`HTTP/1.1 503 Service Unavailable`, `< HTTP/2
/// 404`), as a client prints what it got.
fn http_status(lower: &str) -> bool {
    lower.match_indices("http/").any(|(i, _)| {
        let rest = &lower[i + 5..];
        let version = rest
            .bytes()
            .take_while(|b| b.is_ascii_digit() || *b == b'.')
            .count();
        let code = rest[version..].strip_prefix(' ').unwrap_or("");
        version > 0
            && code.len() >= 3
            && code.as_bytes()[..3].iter().all(u8::is_ascii_digit)
            && !code[3..].starts_with(|c: char| c.is_ascii_digit())
    })
}

/// A label in capitals that heads what follows and addresses the reader
/// (`ACTION REQUIRED: …`, `NOTE: …`, `ATTENTION: …`, `DEPRECATED: …`):
/// a tool or a harness speaking to whoever acts next. Not a log level
/// (`INFO:`, `DEBUG:`) or a setting (`PORT: 8080`): those are output.
fn label(t: &str) -> bool {
    const ADDRESSING: &[&str] = &[
        "ACTION",
        "REQUIRED",
        "ATTENTION",
        "CAUTION",
        "DANGER",
        "IMPORTANT",
        "NOTE",
        "HINT",
        "TIP",
        "REMINDER",
        "DEPRECATED",
        "DEPRECATION",
        "BREAKING",
        "SECURITY",
        "WARNING",
        "ALERT",
    ];
    let Some((key, value)) = t.split_once(':') else {
        return false;
    };
    let words = || key.split(' ');
    words().count() <= 3
        && words().all(|w| w.len() >= 2 && w.bytes().all(|b| b.is_ascii_uppercase()))
        && words().any(|w| ADDRESSING.contains(&w))
        && value.starts_with(' ')
        && value.trim().len() >= 2
}

/// The first line of a traceback, a panic or an uncaught error.
fn traceback_head(t: &str) -> bool {
    t.starts_with("Traceback (most recent call last)")
        || t.starts_with("During handling of the above exception")
        || t.starts_with("The above exception was the direct cause")
        || t.starts_with("Exception in thread")
        || t.starts_with("Uncaught ")
        || (t.starts_with("thread '") && t.contains("panicked"))
        || t.starts_with("goroutine ") && t.ends_with("]:")
}

/// A line that starts with an error, warning or failure word (any case
/// form a tool prints), or names an exception: `ValueError: …`,
/// `django.core.exceptions.ImproperlyConfigured: …`.
fn head(t: &str) -> bool {
    const WORDS: &[&str] = &[
        "error",
        "Error",
        "ERROR",
        "errors",
        "Errors",
        "ERRORS",
        "warning",
        "Warning",
        "WARNING",
        "warn",
        "WARN",
        "Warn",
        "fatal",
        "Fatal",
        "FATAL",
        "failed",
        "Failed",
        "FAILED",
        "fail",
        "Fail",
        "FAIL",
        "failure",
        "Failure",
        "FAILURE",
        "panic",
        "PANIC",
        "Panic",
        // (Severities past error in capitals or capitalised only: in lower
        // case they begin code, `alert(msg)`, `crit = 0.5`.)
        "Critical",
        "CRITICAL",
        "CRIT",
        "ALERT",
        "EMERG",
        "SEVERE",
        "Exception",
        "Caused by",
        "npm ERR!",
        "npm error",
        "--- FAIL",
        "E  ",
        "✗",
        "✘",
        "×",
    ];
    for w in WORDS {
        if let Some(rest) = t.strip_prefix(w) {
            // A word, not the start of a longer one (`errors_total`,
            // `Failover`, `Example`).
            match rest.chars().next() {
                None => return true,
                Some(c) if !(c.is_alphanumeric() || c == '_') => return true,
                _ => {}
            }
        }
    }
    // `SomethingError: …`, `a.b.SomeException`, `KeyboardInterrupt`.
    let name_end = t
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '.'))
        .unwrap_or(t.len());
    let name = &t[..name_end];
    let after = &t[name_end..];
    let last = name.rsplit('.').next().unwrap_or(name);
    let exceptional = [
        "Error",
        "Exception",
        "Interrupt",
        "Exit",
        "Warning",
        "Fault",
    ]
    .iter()
    .any(|s| last.len() > s.len() && last.ends_with(s));
    // A qualified class name before a colon reads as an exception too
    // (`django.core.exceptions.ImproperlyConfigured: …`).
    let qualified = name.contains('.') && after.starts_with(": ");
    (exceptional || qualified)
        && last.starts_with(|c: char| c.is_ascii_uppercase())
        && (after.is_empty() || after.starts_with(':'))
}

/// The name of the tag a line starts with (`<system-reminder>` →
/// `system-reminder`), lower-cased.
fn tag_name(t: &str) -> String {
    let inner = t.trim_start_matches(['<', '/']);
    inner
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '-'))
        .next()
        .unwrap_or("")
        .to_ascii_lowercase()
}

/// A tag an agent wraps a code or an error in: `<returncode>`, `<error>`,
/// `<warning>`, `<tool_use_error>`, `<exit_code>`, `<stderr>`.
fn tag(lower: &str) -> bool {
    let Some(inner) = lower.strip_prefix('<') else {
        return false;
    };
    let inner = inner.strip_prefix('/').unwrap_or(inner);
    let name_end = inner
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '-'))
        .unwrap_or(inner.len());
    let name = &inner[..name_end];
    [
        "error",
        "warning",
        "returncode",
        "exit",
        "status",
        "stderr",
        "denied",
        "exception",
        "reminder",
        "note",
        "feedback",
        "violation",
        "elided",
        "output_head",
        "output_tail",
        "timestamp",
        "environment",
    ]
    .iter()
    .any(|w| name.contains(w))
}

/// A denial: permission, sandbox, a user's or a policy's refusal.
fn denial(lower: &str) -> bool {
    const FORMS: &[&str] = &[
        "denied",
        "not permitted",
        "sandbox",
        "rejected",
        "forbidden",
        "unauthorized",
        "not allowed",
        "requires approval",
        "permission",
        "declined",
        "blocked",
        "restricted",
        "read-only file system",
        "not supported by this environment",
    ];
    FORMS.iter().any(|f| lower.contains(f))
}

/// A timing: a duration printed as the measure of something that ran.
fn timing(lower: &str) -> bool {
    const FORMS: &[&str] = &["wall time", "elapsed", "duration", "took ", "time taken"];
    if FORMS.iter().any(|f| lower.contains(f)) {
        return true;
    }
    // `real 0m0.12s`, `user\t0m0.01s`.
    for p in ["real", "user", "sys"] {
        if let Some(rest) = lower.strip_prefix(p)
            && rest.starts_with(char::is_whitespace)
            && rest.trim_start().starts_with(|c: char| c.is_ascii_digit())
            && rest.trim_end().ends_with('s')
        {
            return true;
        }
    }
    has_duration(lower)
}

/// A number followed by a unit of time (`0.31s`, `12 ms`, `3 seconds`,
/// `1m20s`), standing as a word of its own.
fn has_duration(lower: &str) -> bool {
    let b = lower.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if !b[i].is_ascii_digit()
            || (i > 0 && (b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_'))
        {
            i += 1;
            continue;
        }
        let mut j = i;
        while j < b.len() && (b[j].is_ascii_digit() || b[j] == b'.') {
            j += 1;
        }
        let unit_at = if b.get(j) == Some(&b' ') { j + 1 } else { j };
        let rest = &lower[unit_at.min(lower.len())..];
        for unit in [
            "seconds", "second", "secs", "sec", "ms", "µs", "us", "ns", "minutes", "min", "s",
        ] {
            if let Some(after) = rest.strip_prefix(unit) {
                let ends = after
                    .chars()
                    .next()
                    .is_none_or(|c| !(c.is_alphanumeric() || c == '_'));
                if ends {
                    return true;
                }
            }
        }
        i = j.max(i + 1);
    }
    false
}

/// A whole line in brackets or parentheses that reads as a sentence: the
/// remarks a harness adds to an observation (`[Command finished with exit
/// code 0]`, `[Current working directory: /w]`, `(Open file: /a.py)`,
/// `[File: a.py (120 lines total)]`, `(12 more lines below)`).
fn remark(t: &str) -> bool {
    let inner = match (t.as_bytes().first(), t.as_bytes().last()) {
        (Some(b'['), Some(b']')) | (Some(b'('), Some(b')')) if t.len() > 2 => &t[1..t.len() - 1],
        _ => return false,
    };
    let Some(first) = inner.chars().next() else {
        return false;
    };
    let sentence =
        first.is_uppercase() || (first.is_ascii_digit() && inner.contains(" more lines"));
    sentence && inner.contains(' ') && !inner.starts_with("omitted")
}

/// A line naming where the environment stands: its working directory.
fn state(lower: &str) -> bool {
    lower.contains("working directory")
        || lower.contains("current directory")
        || lower.starts_with("cwd:")
        || lower.starts_with("cwd=")
        || lower.contains(" cwd ")
        || lower.contains("still running")
        || lower.contains("running in the background")
        || lower.contains("running in background")
        || lower.contains("running with session")
}

/// A sentence that reports an outcome: it starts with a capital and holds
/// an outcome word (`File updated.`, `Your command ran successfully…`), or
/// a count of tests (`3 failed, 2 passed`), or a failure any shell prints
/// (`No such file or directory`, `command not found`).
fn outcome(t: &str, lower: &str) -> bool {
    const ANYWHERE: &[&str] = &[
        "no such file",
        "command not found",
        "not found",
        "segmentation fault",
        "core dumped",
        "timed out",
        "out of memory",
        "did not produce any output",
        "no output",
        "traceback",
        "does not match",
        "did not match",
        "no replacement",
        "no matches",
        "no match found",
    ];
    if ANYWHERE.iter().any(|f| lower.contains(f)) {
        return true;
    }
    if test_count(lower) {
        return true;
    }
    const WORDS: &[&str] = &[
        "error",
        "errors",
        "error(s)",
        "failed",
        "fails",
        "failure",
        "failures",
        "success",
        "successful",
        "successfully",
        "succeeded",
        "updated",
        "created",
        "deleted",
        "modified",
        "edited",
        "applied",
        "reverted",
        "saved",
        "written",
        "aborted",
        "interrupted",
        "killed",
        "crashed",
        "cancelled",
        "canceled",
        "invalid",
        "cannot",
        "unable",
        "exception",
        "passed",
        "skipped",
        "completed",
        "finished",
        "done",
        "executed",
    ];
    // A heading's marks do not make it less of a sentence.
    let prose = t.trim_start_matches(['#', ' ']);
    let sentence = prose.starts_with(|c: char| c.is_uppercase()) && prose.contains(' ');
    if sentence && words(lower).any(|w| WORDS.contains(&w)) {
        return true;
    }
    // Strong words anywhere in a line that does not read as code
    // (`make: *** [all] Error 2`, `build failed after 3 retries`).
    const STRONG: &[&str] = &[
        "error",
        "errors",
        "error(s)",
        "failed",
        "failure",
        "exception",
        "aborted",
        "crashed",
        "critical",
        "fatal",
    ];
    !code_like(&strip_code(t)) && words(lower).any(|w| STRONG.contains(&w))
}

/// `3 passed`, `1 failed`, `2 errors`, `Ran 12 tests`, `0 passing, 3
/// failing`, `12 examples, 2 failures`; TAP's failed test and its counts
/// (`not ok 3 - …`, `# fail 1`; a passed test's `ok 3 - …` is a per-test
/// line, as `test a::b ... ok` is).
fn test_count(lower: &str) -> bool {
    let tap = |rest: &str| rest.starts_with(|c: char| c.is_ascii_digit());
    if lower.strip_prefix("not ok ").is_some_and(tap)
        || ["# pass ", "# fail ", "# tests ", "# skip ", "# todo "]
            .iter()
            .any(|p| lower.strip_prefix(p).is_some_and(|r| tap(r.trim_start())))
    {
        return true;
    }
    let mut prev_number = false;
    for w in words(lower) {
        if prev_number
            && matches!(
                w,
                "passed"
                    | "failed"
                    | "passing"
                    | "failing"
                    | "pending"
                    | "failures"
                    | "failure"
                    | "examples"
                    | "assertions"
                    | "specs"
                    | "errors"
                    | "error"
                    | "skipped"
                    | "tests"
                    | "test"
                    | "warnings"
                    | "xfailed"
                    | "xpassed"
                    | "deselected"
                    | "matches"
                    | "match"
                    | "items"
                    | "total"
            )
        {
            return true;
        }
        prev_number = w.bytes().all(|b| b.is_ascii_digit()) && !w.is_empty();
    }
    false
}

/// The words of a lower-cased line: letters, digits, `_`, `(s)` kept on.
fn words(lower: &str) -> impl Iterator<Item = &str> {
    lower
        .split(|c: char| !(c.is_alphanumeric() || c == '_' || c == '(' || c == ')'))
        .map(|w| w.trim_start_matches('(').trim_end_matches(')'))
        .map(|w| w.strip_suffix("(s").unwrap_or(w))
        .filter(|w| !w.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The forms agents print, one line each (see the README's list).
    const STATUS: &[&str] = &[
        // exit and return codes
        "exit code: 1",
        "Exit code 1",
        "Exit code: 0",
        "<returncode>1</returncode>",
        "Process exited with code 0",
        "[Command finished with exit code 0]",
        "exit status 2",
        "Command failed with exit code 127",
        "make: *** [Makefile:12: all] Error 2",
        "[Process completed with exit code 0]",
        // tracebacks and panics
        "Traceback (most recent call last):",
        "thread 'main' panicked at src/main.rs:4:5:",
        "panic: runtime error: index out of range [3] with length 3",
        // heads
        "error: could not compile `visor` (lib) due to 2 previous errors",
        "error[E0425]: cannot find value `x` in this scope",
        "Error: ENOENT: no such file or directory, open 'a.json'",
        "ERROR: Could not find a version that satisfies the requirement foo",
        "warning: unused variable: `y`",
        "FAILED tests/test_a.py::test_b - AssertionError: 1 != 2",
        "FAIL\tgithub.com/a/b\t0.012s",
        "--- FAIL: TestParse (0.00s)",
        "fatal: not a git repository (or any of the parent directories): .git",
        "npm ERR! code ELIFECYCLE",
        "E       AssertionError: assert 1 == 2",
        "ValueError: invalid literal for int() with base 10: 'x'",
        "django.core.exceptions.ImproperlyConfigured: settings are not configured",
        "KeyboardInterrupt",
        "<tool_use_error>File has not been read yet.</tool_use_error>",
        "<warning>The output of your last command was too long.</warning>",
        "<error>",
        // outcomes
        "File updated. Please review the changes and make sure they are correct.",
        "Your command ran successfully and did not produce any output.",
        "Your proposed edit has introduced new syntax error(s). Please understand the fixes and retry your edit commmand.",
        "ls: cannot access 'x': No such file or directory",
        "bash: foo: command not found",
        "=== 3 failed, 12 passed in 0.31s ===",
        "Ran 12 tests in 0.004s",
        "test result: FAILED. 3 passed; 1 failed; 0 ignored",
        "Command executed.",
        "The edit was applied successfully.",
        "Segmentation fault (core dumped)",
        // denials
        "Permission denied",
        "The user denied this operation.",
        "Permission to use Bash has been denied.",
        "The user doesn't want to proceed with this tool use. The tool use was rejected.",
        "failed in sandbox: operation not permitted",
        // timings
        "Wall time: 0.5012 seconds",
        "real\t0m0.120s",
        "user 0m0.01s",
        "Finished `dev` profile [unoptimized + debuginfo] target(s) in 4.21s",
        "ok  \tgithub.com/a/b\t0.012s",
        "took 3 ms",
        // remarks and state
        "[Current working directory: /workspace]",
        "[Python interpreter: /usr/bin/python]",
        "[Below is the output of the previous command.]",
        "(Open file: /repo/src/marshmallow/fields.py)",
        "(Current directory: /repo)",
        "[File: /repo/a.py (120 lines total)]",
        "(12 more lines below)",
        "cwd: /home/user/project",
        // more forms agents print (SWE-agent, mini-swe-agent, OpenHands,
        // Aider, Codex, Claude Code, Goose, Cline), read from their sources
        "[The command completed with exit code 130. CTRL+C was sent.]",
        "<returncode>-1</returncode>",
        "\"returncode\": 1,",
        "Exit code 143",
        "Command exited with code 7",
        "Command executed successfully (exit code 0).",
        "Command terminated by signal SIGKILL.",
        "<exit_code>0</exit_code>",
        "{\"output\":\"ok\\n\",\"metadata\":{\"exit_code\":0,\"duration_seconds\":0.2}}",
        "[1]+  Exit 1                  python3 app.py > server.log 2>&1",
        "Output:",
        "(no output)",
        "[Code executed successfully with no output]",
        "Command running in background with ID: b2f8b9",
        "Process running with session ID 3",
        "<status>completed</status>",
        "Command is still running in the user's terminal.",
        "Success. Updated the following files:",
        "File created successfully at: /testbed/reproduce.py",
        "The file /testbed/a.py has been edited. Here's the result of running `cat -n` on a snippet of /testbed/a.py:",
        "Last edit to /testbed/a.py undone successfully.",
        "# The other 2 SEARCH/REPLACE blocks were applied successfully.",
        "[Jupyter current working directory: /workspace]",
        "Shell cwd was reset to /home/user/project",
        "(1471 more lines above)",
        "[Previous command outputs are truncated. Showing the last 120 lines of the output below.]",
        "[Error occurred in processing last action]",
        "[Last action has been rejected by the user]",
        "EXECUTION RESULT of [execute_bash]:",
        "OBSERVATION:",
        "[execute_command for 'npm test'] Result:",
        "[Request interrupted by user for tool use]",
        "<system-reminder>",
        "<tool_use_error>Cancelled: parallel tool call Bash(npm test) errored</tool_use_error>",
        "<exception>An error occurred while executing the command: Command 'sleep 100' timed out after 60 seconds</exception>",
        "Chunk ID: 5f2c1a",
        "Original token count: 18234",
        "Total output lines: 4812",
        "<elided_chars>",
        "12345 characters elided",
        "<output_head>",
        "Warning: truncated output (original token count: 18234)",
        "... [2345 characters truncated] ...",
        "NOTE: Output was 812 lines, showing only the last 100 lines.",
        "... (340 earlier lines dropped) ...",
        "[The command timed out after 120 seconds. You may wait longer to see additional output.]",
        "Command timed out after 2m 0s",
        "command timed out after 10000 milliseconds",
        "The command 'python server.py' was cancelled because it took more than 30 seconds.",
        "Killed",
        "User denied the tool execution",
        "The user denied this edit. The file was NOT modified and still contains its original content.",
        "Claude requested permissions to use Bash, but you haven't granted it yet.",
        "The user has declined to run this tool. DO NOT attempt to call this tool again.",
        "exec command rejected by user",
        "Operation 'vim' is not supported by this environment.",
        "Command execution blocked by CLINE_COMMAND_PERMISSIONS: rm is not allowed.",
        "Access to .env is blocked by the .clineignore file settings.",
        "The command attempts to access '.env' which is restricted by .gooseignore",
        "<sandbox_violations>",
        "touch: cannot touch '/etc/x': Read-only file system",
        "mkdir: /tmp/codex-new-repo: Operation not permitted",
        "ModuleNotFoundError: No module named 'astropy'",
        "SyntaxError: invalid syntax",
        "During handling of the above exception, another exception occurred:",
        "ERROR:",
        "Error: No such tool available: Foo",
        "The tool execution failed with the following error:",
        "[ERROR] You did not use a tool in your previous response! Please retry with a tool use.",
        "execution error: Sandbox(Timeout { .. })",
        "Error executing command: spawn ENOENT",
        "Format error:",
        "Your bash command contained syntax errors and was NOT executed.",
        "Your changes have NOT been applied. Please fix your edit command and try again.",
        "<NOTE>Your edits have been applied, but the linter has found syntax errors.</NOTE>",
        "No replacement was performed, old_str `foo` did not appear verbatim in /testbed/a.py.",
        "String to replace not found in file.",
        "# 1 SEARCH/REPLACE block failed to match!",
        "UnifiedDiffNoMatch: hunk failed to apply!",
        "...does not match anything in the file.",
        "# Fix any errors below, if possible.",
        "bash: line 1: nosuchcmd: command not found",
        "thread 'tests::bad' (10626) panicked at src/lib.rs:6:24:",
        "==================== 2 failed, 1 passed, 1 skipped in 0.03s ====================",
        "collected 4 items",
        "no tests ran in 0.01s",
        "Interrupted: 1 error during collection",
        "FAILED (failures=1, errors=1)",
        "test tests::bad ... FAILED",
        "error: test failed, to rerun pass `--lib`",
        "--- PASS: TestFoo (0.00s)",
        "PASS",
        "Tests:       1 failed, 5 passed, 6 total",
        "Found 3 matches for \"foo\" in /testbed:",
        "No matches found for \"foo\" in /testbed",
        "0.00user 0.00system 0:00.10elapsed 0%CPU (0avgtext+0avgdata 1680maxresident)k",
        "Time:        1.234 s",
        "<timestamp>2025-12-01T04:48:27.908Z</timestamp>",
        "- E999 SyntaxError: unmatched ')'",
        "- line 12 col 5: F821 undefined name 'foo'",
        "src/app.py:12:5: F821 undefined name 'foo'",
        "main.c:3: error: expected ';' before '}' token",
        "src/lib.rs:4:9: warning: unused variable `x`",
        "    raised KeyError: 'missing'",
        // forms an outside review found missed (agents not in the corpus)
        "No match found for the specified text.",
        "assertion `left == right` failed",
        "  left: [\"a\", \"b\"]",
        " right: [\" a \", \"b\"]",
        "Expected: 3",
        "/testbed/slugkit/special.py:12: DeprecationWarning: invalid escape sequence",
        "tests/test_store.py:71: AssertionError",
        "    sender_test.go:57: attempts = 3, want 1",
        "Did you mean to match some of these actual lines from todo/cli.py?",
        "The SEARCH section must exactly match an existing block of lines including all white space, comments, indentation, docstrings, etc",
        "Please try a different command that produces less output.",
        "Review the changes and make sure they are as expected. Edit the file again if necessary.",
        "IMPORTANT: For any future changes to this file, use the final_file_content shown above as your reference.",
        "Now that you have the latest state of the file, try the operation again with fewer, more precise SEARCH blocks.",
        // kinds a black-box run found missed inside a repeated run
        // (2026-11-30): codes as a key and value, test summaries of other
        // runners, HTTP status lines, severities, system errors, a
        // process's end, labels and reminders addressed to the reader
        "rc=2",
        "rc: 1",
        "exit=1",
        "exited 1",
        "code=1",
        "status: 1",
        "status=failed",
        "result: error",
        "job finished, status=failed",
        "0 passing, 3 failing",
        "  3 passing (12ms)",
        "  2 pending",
        "12 examples, 2 failures",
        "not ok 3 - parses an empty file",
        "# fail  1",
        "HTTP/1.1 503 Service Unavailable",
        "< HTTP/2 404",
        "CRITICAL: disk full",
        "2026-11-30 00:01:02 CRITICAL worker 3 lost its lease",
        "[2026-11-30T00:01:02Z] FATAL could not bind 0.0.0.0:80",
        "OOMKilled",
        "Reason: OOMKilled",
        "connect ETIMEDOUT 10.0.0.1:443",
        "ECONNREFUSED 127.0.0.1:5432",
        "write failed: ENOSPC",
        "Terminated by SIGKILL",
        "ACTION REQUIRED: rotate the key before Friday",
        "ATTENTION: the staging database is read-only",
        "Remember to run migrations.",
    ];

    /// Lines of output and code that are not status (they may go in a run).
    const OUTPUT: &[&str] = &[
        "fn step_1(input: &str) -> Result<usize, Error> {",
        "    let parsed = input.trim().parse::<usize>()?;",
        "}",
        "",
        "import os",
        "    return self.value",
        "[10:00] alice: the retention policy needs a tax branch first",
        "- alice: can you look at the deploy doc",
        "[1, 2, 3]",
        "def errors_total(self):",
        "Failover is configured per upstream.",
        "class Example(Base):",
        "    \"\"\"Return the parsed value.\"\"\"",
        "total 48",
        "drwxr-xr-x  5 root root 4096 Nov 26 19:28 src",
        "[omitted: message 3 lines 1-6]",
        "  File \"a.py\", line 3, in <module>",
        "    x = int(s)",
        "MAX_SECONDS = 5",
        "version = \"1.2s3\"",
        "<output>",
        "</output>",
        "1472:            return value",
        "     3\u{2192}import os",
        "Collecting flask",
        "def add(a, b):",
        "1466:            raise ValueError(msg)",
        "src/a.py:12:    def foo():",
        "- alice: the deploy doc is ready for review",
        "   6: \t\"errors\"",
        "  12: // ErrGaveUp is returned when every attempt failed.",
        "     4\u{2192}    if err != nil { return fmt.Errorf(\"failed: %w\", err) }",
        "    12\tlogger.error(\"timed out\")",
        "src/a.py:12:    def foo():",
        "    # you can pass a custom parser here",
        // near the forms above, and not status
        "worker 3: processed 39 records from the nightly import batch without issues",
        "    status = self.status",
        "    if code == 1:",
        "    return 0;",
        "    rc = subprocess.call(args)",
        "code: |",
        "status: {{ .Values.status }}",
        "see http/2 and http/3 in the docs",
        "PATH",
        "encoding: utf-8 (the default for this table of names)",
        "INFO:     127.0.0.1:54321 - \"GET /health HTTP/1.1\" 200 OK",
        "INFO:     Started server process [1]",
        "INFO: Analyzed target //app:server (12 packages loaded).",
        "DEBUG: cache miss for key user:42",
        "time=2026-11-30T00:01:02Z level=INFO msg=req path=/ status=200 dur=3",
        "alert(\"saved\");",
        "crit = 0.5",
        "severe = True",
        "critical_path = []",
        "okay 3 more to go",
        "ok 1 - reads the config",
        "passes 3 values through",
    ];

    #[test]
    fn every_form_agents_print_is_status() {
        let missed: Vec<&&str> = STATUS.iter().filter(|l| !is_status(l)).collect();
        assert!(missed.is_empty(), "not status: {missed:#?}");
    }

    #[test]
    fn output_and_code_lines_are_not() {
        let wrong: Vec<&&str> = OUTPUT.iter().filter(|l| is_status(l)).collect();
        assert!(wrong.is_empty(), "status: {wrong:#?}");
    }

    #[test]
    fn a_traceback_keeps_its_first_and_last_lines_whatever_the_exception_is_called() {
        let text = "Traceback (most recent call last):\n  File \"a.py\", line 3, in <module>\n    x = int(s)\nmymod.NotAnInteger\nnext line";
        let lines: Vec<&str> = text.split('\n').collect();
        assert_eq!(mark(&lines), vec![true, false, false, true, false]);
    }

    #[test]
    fn a_reminder_the_harness_adds_stays_whole() {
        let text = "line one of a file\n<system-reminder>\nWhenever you read a file, consider whether it is malware.\n</system-reminder>\nafter";
        let lines: Vec<&str> = text.split('\n').collect();
        assert_eq!(mark(&lines), vec![false, true, true, true, false]);
        // A worked example in a result (mini-swe-agent's format error).
        let text = "Format error:\n<response_example>\nTHOUGHT: look first\n```mswea_bash_command\nls -la\n```\n</response_example>\nfiles";
        let lines: Vec<&str> = text.split('\n').collect();
        assert_eq!(
            mark(&lines),
            vec![true, true, true, true, true, true, true, false]
        );
        // A tag never closed keeps 64 lines, not the rest of the result.
        let text = format!("<warning>\n{}", vec!["output line"; 100].join("\n"));
        let lines: Vec<&str> = text.split('\n').collect();
        assert_eq!(mark(&lines).iter().filter(|&&s| s).count(), 64);
    }

    proptest::proptest! {
        #[test]
        fn any_text_is_read_without_panicking(text in "\\PC{0,80}(\n\\PC{0,80}){0,4}", word in "[-*•> ]{0,3}[A-Za-z→é]{0,12}(Error|Exception)?[:( ]?") {
            let joined = format!("{word}{text}");
            let lines: Vec<&str> = joined.split('\n').collect();
            proptest::prop_assert_eq!(mark(&lines).len(), lines.len());
        }
    }

    #[test]
    fn non_ascii_around_the_forms_is_read() {
        assert!(!is_status("    2→check:"));
        assert!(is_status("→ ValueError: bad"));
        assert!(is_status("  ✗ 3 failed"));
    }

    #[test]
    fn indented_forms_count_and_case_does_not_matter_where_agents_vary() {
        assert!(is_status("    EXIT CODE: 3"));
        assert!(is_status("  Error: boom"));
        assert!(!is_status(&"x".repeat(500)), "a long line is output");
    }
}
