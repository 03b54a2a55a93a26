//! The API contract on the host backend, table-driven: every pointer of
//! every operation set to NULL in turn, every other input made bad in turn
//! (the walks of `common::walk`, which a GPU test can run with device
//! buffers), the header's word on each pointer, and the regressions of the
//! defects found by hand: a combine of a layout its dispatch did not
//! produce, bad low-latency combines, mismatched collectives across ranks,
//! leaks of failed creations, and the alignment range of the capacity query.

mod common;

use common::calls::*;
use common::walk::*;
use common::*;
use ep::capi::*;
use ep::runtime::contract::{self, Field};
use std::ptr::null_mut;
use std::time::{Duration, Instant};

static HOST: HostMem = HostMem;

/// The walks' group of 2 ranks ([`contract_shape`]).
fn shape() -> Shape {
    contract_shape(2)
}

#[test]
fn null_walk_of_the_normal_mode() {
    let s = shape();
    run_world(s.world, &s.config(), |rank, ctx| {
        walk::null_walk_of_the_normal_mode(&HOST, &s, ctx, rank, &SOME)
    });
}

#[test]
fn null_walk_of_the_low_latency_mode() {
    let s = shape();
    run_world(s.world, &s.config(), |rank, ctx| {
        walk::null_walk_of_the_low_latency_mode(&HOST, &s, ctx, rank, &LL_SOME)
    });
}

#[test]
fn bad_input_walk() {
    let s = shape();
    run_world(s.world, &s.config(), |rank, ctx| {
        walk::bad_input_walk(&HOST, &s, ctx, rank, (&SOME, &LL_SOME), true)
    });
}

/// The doc comment above each field of `strukt` in include/ep.h, with its
/// lines joined: (field name, is a pointer, doc).
fn header_fields(header: &str, strukt: &str) -> Vec<(String, bool, String)> {
    let start = header
        .find(&format!("typedef struct {strukt} {{"))
        .unwrap_or_else(|| panic!("{strukt} is not in the header"));
    let end = start + header[start..].find(&format!("}} {strukt};")).unwrap();
    let mut fields = Vec::new();
    let mut doc = Vec::new();
    for line in header[start..end].lines().skip(1) {
        let line = line.trim();
        if let Some(text) = line.strip_prefix("//") {
            doc.push(text.trim().to_string());
        } else if let Some(decl) = line.strip_suffix(';') {
            let name = decl.rsplit([' ', '*']).next().unwrap().to_string();
            fields.push((name, decl.contains('*'), doc.join(" ")));
            doc.clear();
        }
    }
    fields
}

/// Every pointer field of every args struct is in the runtime's contract
/// table, and its header doc states the table's rule word for word.
#[test]
fn the_header_states_every_pointer_rule_of_the_tables() {
    let header = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/include/ep.h"))
        .expect("include/ep.h");
    let tables: [(&str, Vec<Field>); 6] = [
        (
            "ep_dispatch_args_t",
            contract::fields(contract::DISPATCH).copied().collect(),
        ),
        (
            "ep_combine_args_t",
            contract::fields(contract::COMBINE).copied().collect(),
        ),
        (
            "ep_ll_dispatch_args_t",
            contract::fields(contract::LL_DISPATCH).copied().collect(),
        ),
        (
            "ep_ll_combine_args_t",
            contract::fields(contract::LL_COMBINE).copied().collect(),
        ),
        (
            "ep_mega_args_t",
            contract::fields(contract::MEGA).copied().collect(),
        ),
        (
            "ep_moe_args_t",
            contract::fields(contract::MOE).copied().collect(),
        ),
    ];
    for (strukt, table) in &tables {
        let fields = header_fields(&header, strukt);
        for (name, pointer, doc) in &fields {
            if !pointer {
                continue;
            }
            let field = table
                .iter()
                .find(|f| f.name == name)
                .unwrap_or_else(|| panic!("{strukt}.{name} is a pointer missing from the table"));
            assert!(
                doc.contains(&field.doc()),
                "{strukt}.{name}: the header says {doc:?}, the table {:?}",
                field.doc()
            );
        }
        for field in table {
            assert!(
                fields.iter().any(|(n, p, _)| n == field.name && *p),
                "{strukt} has no pointer field {}",
                field.name
            );
        }
    }
    // The layout's pointers are parameters: its doc states each rule.
    let layout = header.find("ep_status_t ep_get_dispatch_layout(").unwrap();
    let doc_start = header[..layout].rfind("\n\n").unwrap();
    let doc: String = header[doc_start..layout]
        .lines()
        .map(|l| l.trim().trim_start_matches("//").trim())
        .collect::<Vec<_>>()
        .join(" ");
    for field in contract::fields(contract::LAYOUT) {
        let sentence = field.doc();
        let rule = sentence.strip_suffix('.').unwrap_or(&sentence);
        let rule = rule[..1].to_lowercase() + &rule[1..];
        assert!(
            doc.contains(&format!("`{}`: {rule}", field.name)),
            "ep_get_dispatch_layout's doc lacks \"`{}`: {rule}\": {doc}",
            field.name
        );
    }
}

/// Every pointer parameter of every function is named in its doc, which
/// says whether it is required or may be NULL.
#[test]
fn the_header_names_every_pointer_parameter() {
    let header = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/include/ep.h"))
        .expect("include/ep.h");
    let mut checked = 0;
    for (at, _) in header.match_indices("\nep_status_t ep_") {
        let decl_end = at + header[at..].find(';').unwrap();
        let decl = &header[at..decl_end];
        let doc_start = header[..at].rfind("\n\n").unwrap();
        let doc: Vec<&str> = header[doc_start..at]
            .lines()
            .map(|l| l.trim().trim_start_matches("//").trim())
            .collect();
        let doc = doc.join(" ");
        let params = &decl[decl.find('(').unwrap() + 1..];
        for param in params.split(',') {
            let param = param.trim().trim_end_matches(')');
            if !(param.contains('*') || param.starts_with("ep_stream_t")) {
                continue;
            }
            let name = param.rsplit([' ', '*']).next().unwrap();
            assert!(
                doc.contains(&format!("`{name}`")),
                "{}: the doc does not name `{name}`",
                decl.trim()
            );
            checked += 1;
        }
        assert!(
            !params.contains('*') || doc.contains("required") || doc.contains("may be NULL"),
            "{}: the doc says nothing of its pointers",
            decl.trim()
        );
    }
    assert!(checked > 30, "only {checked} pointer parameters found");
}

/// Dispatch with one output, then combine with the other layout: refused on
/// every rank before anything is read (on both backends: the check is the
/// runtime's), and the right layout still works.
#[test]
fn combine_of_a_layout_the_dispatch_did_not_produce_is_refused() {
    let s = shape();
    run_world(s.world, &s.config(), |rank, ctx| {
        let tokens = Tokens::new(&s, 31, &SOME, false);
        for (source_order, expert_major) in [(true, false), (false, true)] {
            let case = DispatchCase {
                source_order,
                expert_major,
                ..both(1)
            };
            let mut d = DispatchCall::new(&HOST, &s, &tokens, rank, case);
            let h = ctx.handle();
            assert_eq!(d.run(ctx, h.0), EP_SUCCESS, "{}", last_error());
            let all: Vec<_> = (0..s.world).map(|r| tokens.dispatched(&s, r, 1)).collect();
            let mut wrong = CombineCall::new(&HOST, &s, rank, SOME[rank], &all, 32, source_order);
            expect_error(
                wrong.run(ctx, h.0),
                EP_ERR_INVALID_ARGUMENT,
                "ep_combine",
                &["input_layout", "produced no"],
                "a combine of the other layout",
            );
            assert!(wrong.call.untouched());
            let mut right = CombineCall::new(&HOST, &s, rank, SOME[rank], &all, 32, expert_major);
            assert_eq!(right.run(ctx, h.0), EP_SUCCESS, "{}", last_error());
            right.check(0.0).unwrap();
        }
    });
}

/// Runs `body` in a process of its own (this test binary, running only
/// `test`), so that it sees no other test's threads and descriptors, and
/// fails if it fails or anything reaches its stderr.
fn run_alone(test: &str, body: impl FnOnce()) {
    const ALONE: &str = "EP_TEST_ALONE";
    if std::env::var(ALONE).as_deref() == Ok(test) {
        return body();
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--test-threads=1"])
        .env(ALONE, test)
        .env_remove("RUST_BACKTRACE")
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success() && stdout.contains("1 passed") && stderr.trim().is_empty(),
        "{test} alone: {}\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
}

/// After a successful low-latency dispatch, combines with an expert id out
/// of range, with another routing than the dispatch's, and with fewer tokens
/// and NULL weights are refused with EP_ERR_INVALID_ARGUMENT before anything
/// is computed; nothing panics or reaches stderr, and the context stays
/// usable. Also when only one rank's call is bad: it is not made there, so
/// that rank's corrected call pairs with the peer's.
#[test]
fn bad_low_latency_combines_are_refused_and_the_context_stays_usable() {
    run_alone(
        "bad_low_latency_combines_are_refused_and_the_context_stays_usable",
        || {
            let s = shape();
            run_world(s.world, &s.config(), |rank, ctx| {
                let ll = LlTokens::new(&s, 41, &LL_SOME);
                let weighted = ll_dispatch_case(true, true, false);
                let case = LlCombineCase {
                    weights: true,
                    zero_copy: false,
                    split: false,
                    device_count: false,
                };
                let mut op = LlCombineOp::new(&HOST, &s, &ll, rank, 42, weighted, case);
                let e = s.experts as i32;
                type Change = fn(&mut LlCombineOp, i32);
                let bad: [(&str, Change); 3] = [
                    ("an id out of range", |o, e| {
                        o.call
                            .call
                            .replace("topk_idx", |idx: &mut Vec<i32>| idx[2] = e)
                    }),
                    ("another routing", |o, _| {
                        o.call
                            .call
                            .replace("topk_idx", |idx: &mut Vec<i32>| other_routing(idx))
                    }),
                    ("fewer tokens, NULL weights", |o, _| {
                        o.call.call.args.num_tokens -= 1;
                        o.call.call.null("topk_weights");
                    }),
                ];
                for (what, change) in bad {
                    // Every rank, then rank 0 only (rank 1's good call waits
                    // for rank 0's corrected one).
                    for only_rank0 in [false, true] {
                        op.call.call.restore();
                        op.prepare(ctx);
                        op.call.call.poison();
                        if !only_rank0 || rank == 0 {
                            change(&mut op, e);
                            let status = op.run(ctx, 0);
                            expect_error(
                                status,
                                EP_ERR_INVALID_ARGUMENT,
                                "ep_ll_combine",
                                &[],
                                what,
                            );
                            assert!(op.call.call.untouched(), "{what}: an output was written");
                            op.call.call.restore();
                        }
                        assert_eq!(op.run(ctx, 0), EP_SUCCESS, "{what}, then: {}", last_error());
                        op.check().unwrap();
                    }
                }
                // The context still serves local calls.
                let tokens = Tokens::new(&s, 43, &SOME, false);
                let mut layout = LayoutOp::new(&HOST, &s, &tokens, rank);
                assert_eq!(layout.run(ctx, 0), EP_SUCCESS, "{}", last_error());
                layout.check().unwrap();
            });
        },
    );
}

fn timed<T>(body: impl FnOnce() -> T) -> (T, Duration) {
    let start = Instant::now();
    let out = body();
    (out, start.elapsed())
}

/// Ranks in different collective calls all end promptly in EP_ERR_REMOTE
/// naming both calls, with nothing written, and their next matching calls
/// work: LL dispatch against dispatch, combine against dispatch, a rank
/// that skipped a call because its local checks failed, and combines of
/// different dispatches.
#[test]
fn mismatched_collectives_end_in_remote_errors_on_every_rank() {
    let s = shape();
    let mut cfg = s.config();
    cfg.timeout_ms = 60_000;
    run_world(s.world, &cfg, |rank, ctx| {
        let tokens = Tokens::new(&s, 51, &SOME, false);
        let ll = LlTokens::new(&s, 52, &LL_SOME);
        let mut dispatch = DispatchOp::new(&HOST, ctx, &s, &tokens, rank, both(1));
        let mut ll_dispatch =
            LlDispatchOp::new(&HOST, &s, &ll, rank, ll_dispatch_case(true, true, false));
        let mut combine = CombineOp::new(&HOST, ctx, &s, &tokens, rank, 53, false);
        let remote = |(status, took): (ep_status_t, Duration), function: &str, needles: &[&str]| {
            let what = format!("rank {rank}: {needles:?}");
            expect_error(status, EP_ERR_REMOTE, function, needles, &what);
            assert!(took < Duration::from_secs(5), "{what}: took {took:?}");
        };

        // Rank 0 in ep_ll_dispatch, rank 1 in ep_dispatch.
        dispatch.pointers().poison();
        ll_dispatch.pointers().poison();
        let result = timed(|| {
            if rank == 0 {
                ll_dispatch.run(ctx, 0)
            } else {
                dispatch.run(ctx, 0)
            }
        });
        let function = ["ep_ll_dispatch", "ep_dispatch"][rank];
        let other = 1 - rank;
        remote(
            result,
            function,
            &[
                &format!("rank {other} is in"),
                "ep_ll_dispatch call #1",
                "ep_dispatch call #1",
            ],
        );
        assert!(dispatch.pointers().untouched() && ll_dispatch.pointers().untouched());
        assert_eq!(dispatch.run(ctx, 0), EP_SUCCESS, "{}", last_error());
        dispatch.check().unwrap();

        // Rank 0 combines while rank 1 dispatches again.
        combine.prepare(ctx);
        combine.pointers().poison();
        let result = timed(|| {
            if rank == 0 {
                combine.run(ctx, 0)
            } else {
                dispatch.run(ctx, 0)
            }
        });
        let function = ["ep_combine", "ep_dispatch"][rank];
        remote(
            result,
            function,
            &[
                "ep_combine call #4 (combining the dispatch of call #3)",
                "ep_dispatch call #4",
            ],
        );
        assert!(combine.pointers().untouched());

        // Rank 1's dispatch fails its checks (NULL x) and rank 1 goes on to
        // the combine: rank 0 is still in the dispatch.
        let result = timed(|| {
            if rank == 1 {
                dispatch.pointers().null("x");
                assert_eq!(dispatch.run(ctx, 0), EP_ERR_NULL_POINTER);
                dispatch.pointers().restore();
                combine.run(ctx, 0)
            } else {
                dispatch.run(ctx, 0)
            }
        });
        let function = ["ep_dispatch", "ep_combine"][rank];
        remote(
            result,
            function,
            &["ep_dispatch call #5", "ep_combine call #5"],
        );

        // Both ranks dispatch into two handles; each combines another one.
        let mut second = DispatchOp::new(&HOST, ctx, &s, &tokens, rank, both(1));
        assert_eq!(dispatch.run(ctx, 0), EP_SUCCESS, "{}", last_error());
        assert_eq!(second.run(ctx, 0), EP_SUCCESS, "{}", last_error());
        let handle = if rank == 0 {
            &dispatch.handle
        } else {
            &second.handle
        };
        let result = timed(|| combine.call.run(ctx, handle.0));
        remote(
            result,
            "ep_combine",
            &[
                "combining the dispatch of call #6",
                "combining the dispatch of call #7",
            ],
        );

        // Matching calls work again, and a call refused on one rank only
        // pairs with its corrected retry.
        combine.pointers().restore();
        combine.prepare(ctx);
        combine.pointers().poison();
        if rank == 0 {
            combine.pointers().null("x");
            assert_eq!(combine.run(ctx, 0), EP_ERR_NULL_POINTER);
            combine.pointers().restore();
        }
        assert_eq!(combine.run(ctx, 0), EP_SUCCESS, "{}", last_error());
        combine.check().unwrap();
    });
}

/// Ten ep_ctx_create calls that fail their checks leave no rendezvous
/// thread or socket behind; a rank that joined an id whose creator then
/// failed is told at once (EP_ERR_REMOTE naming the cause), not at its
/// timeout.
#[test]
fn failed_creates_release_their_rendezvous() {
    run_alone("failed_creates_release_their_rendezvous", || {
        let mut bad = shape().config();
        bad.hidden = 100;
        let before = fds_and_threads();
        for _ in 0..10 {
            let mut ctx = null_mut();
            let status = unsafe { ep_ctx_create(&mut ctx, 2, unique_id(), 0, 0, &bad) };
            assert_eq!(status, EP_ERR_INVALID_ARGUMENT);
            assert!(ctx.is_null());
        }
        let deadline = Instant::now() + Duration::from_secs(3);
        while fds_and_threads() != before && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(
            fds_and_threads(),
            before,
            "(descriptors, threads) before and after"
        );

        let good = shape().config();
        let id = unique_id();
        let joined = std::thread::spawn(move || {
            let mut ctx = null_mut();
            let (status, took) = timed(|| unsafe { ep_ctx_create(&mut ctx, 2, id, 1, 0, &good) });
            (status, took, last_error())
        });
        std::thread::sleep(Duration::from_millis(300));
        let status = unsafe { ep_ctx_create(&mut null_mut(), 2, id, 0, 0, &bad) };
        assert_eq!(status, EP_ERR_INVALID_ARGUMENT);
        let (status, took, msg) = joined.join().unwrap();
        assert_eq!(status, EP_ERR_REMOTE, "{msg}");
        assert!(
            msg.contains("rank 0's ep_ctx_create failed") && msg.contains("hidden"),
            "{msg}"
        );
        assert!(took < Duration::from_secs(5), "took {took:?}");
    });
}

/// `ep_get_dispatch_capacity` takes exactly the alignments `ep_dispatch`
/// takes, with the same message.
#[test]
fn capacity_and_dispatch_share_the_alignment_range() {
    let s = shape();
    let ctx = Ctx::single(&Shape { world: 1, ..s }.config());
    let tokens = Tokens::new(&Shape { world: 1, ..s }, 61, &[5], false);
    let case = DispatchCase {
        expert_major: false,
        ..both(1)
    };
    let mut d = DispatchCall::new(&HOST, &Shape { world: 1, ..s }, &tokens, 0, case);
    let h = ctx.handle();
    for (alignment, ok) in [
        (0, true),
        (1, true),
        (1024, true),
        (1025, false),
        (-1, false),
    ] {
        let mut rows = 0;
        let status = unsafe { ep_get_dispatch_capacity(ctx.0, alignment, null_mut(), &mut rows) };
        let capacity_msg = last_error();
        d.call.args.expert_alignment = alignment;
        let dispatch_status = d.run(&ctx, h.0);
        let dispatch_msg = last_error();
        if ok {
            assert_eq!(
                (status, dispatch_status),
                (EP_SUCCESS, EP_SUCCESS),
                "{alignment}: {capacity_msg} / {dispatch_msg}"
            );
        } else {
            assert_eq!(
                (status, dispatch_status),
                (EP_ERR_INVALID_ARGUMENT, EP_ERR_INVALID_ARGUMENT)
            );
            let why = |m: &str| m[m.find(": ").unwrap() + 2..].to_string();
            assert_eq!(why(&capacity_msg), why(&dispatch_msg));
            assert!(capacity_msg.contains(&format!("expert_alignment = {alignment}")));
        }
    }
}

/// A whole low-latency combine that fails after its exchange leaves no call
/// half done: the next dispatch works, and a receive-only call says that no
/// send-only call is due (not that a combine "ran its send phase only").
#[test]
fn a_failed_low_latency_combine_leaves_no_half_call() {
    let s = shape();
    run_world(s.world, &s.config(), |rank, ctx| {
        let ll = LlTokens::new(&s, 71, &LL_SOME);
        // Rank 0's dispatch has weights, rank 1's not; rank 0's combine then
        // leaves its weights out, which needs every rank's.
        let case = ll_dispatch_case(true, rank == 0, false);
        let combine_case = LlCombineCase {
            weights: rank == 1,
            zero_copy: false,
            split: false,
            device_count: false,
        };
        let mut op = LlCombineOp::new(&HOST, &s, &ll, rank, 72, case, combine_case);
        op.prepare(ctx);
        let status = op.run(ctx, 0);
        if rank == 0 {
            expect_error(
                status,
                EP_ERR_INVALID_ARGUMENT,
                "ep_ll_combine",
                &["not every rank's dispatch was given weights"],
                "rank 0",
            );
        } else {
            assert_eq!(status, EP_SUCCESS, "{}", last_error());
        }
        let mut next =
            LlDispatchOp::new(&HOST, &s, &ll, rank, ll_dispatch_case(false, true, false));
        assert_eq!(next.run(ctx, 0), EP_SUCCESS, "{}", last_error());
        next.check().unwrap();
        next.call.call.args.flags = EP_LL_RECV_ONLY;
        let status = next.run(ctx, 0);
        expect_error(
            status,
            EP_ERR_INVALID_ARGUMENT,
            "ep_ll_dispatch",
            &["EP_LL_RECV_ONLY without a matching EP_LL_SEND_ONLY call"],
            "a receive-only call",
        );
        assert!(!last_error().contains("ran its send phase only"));
    });
}

/// A context whose collective failed for good (a peer that never came)
/// refuses every call with that status until destroyed, and says so in
/// ep_ctx_get_async_error; destroying it is clean.
#[test]
fn a_context_that_failed_for_good_refuses_every_call() {
    let s = shape();
    let mut cfg = s.config();
    cfg.timeout_ms = 600;
    run_world(s.world, &cfg, |rank, ctx| {
        if rank == 1 {
            // Alive but silent: rank 0's collective waits for it in vain.
            return std::thread::sleep(Duration::from_millis(2000));
        }
        let tokens = Tokens::new(&s, 81, &SOME, false);
        let mut dispatch = DispatchOp::new(&HOST, ctx, &s, &tokens, rank, both(1));
        assert_eq!(dispatch.run(ctx, 0), EP_ERR_TIMEOUT, "{}", last_error());
        let mut layout = LayoutOp::new(&HOST, &s, &tokens, rank);
        let mut ll = LlDispatchOp::new(
            &HOST,
            &s,
            &LlTokens::new(&s, 82, &LL_SOME),
            rank,
            ll_dispatch_case(true, true, false),
        );
        let mut handle = null_mut();
        let mut buffer = null_mut();
        let statuses = [
            ("ep_dispatch", dispatch.run(ctx, 0)),
            ("ep_get_dispatch_layout", layout.run(ctx, 0)),
            ("ep_ll_dispatch", ll.run(ctx, 0)),
            ("ep_handle_create", unsafe {
                ep_handle_create(ctx.0, &mut handle)
            }),
            ("ep_ll_get_combine_buffer", unsafe {
                ep_ll_get_combine_buffer(ctx.0, &mut buffer, null_mut())
            }),
        ];
        for (function, status) in statuses {
            assert_eq!(status, EP_ERR_TIMEOUT, "{function} after a timeout");
        }
        assert!(last_error().contains("destroy it"), "{}", last_error());
        let mut async_status = 0;
        assert_eq!(
            unsafe { ep_ctx_get_async_error(ctx.0, &mut async_status) },
            EP_SUCCESS
        );
        assert_eq!(async_status, EP_ERR_TIMEOUT);
        assert!(layout.pointers().untouched());
    });
}
