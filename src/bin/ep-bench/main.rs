//! `ep-bench`: times `ep`'s normal-mode and low-latency operations across
//! the GPUs of one host (one thread and one context per GPU), next to an NCCL
//! all-to-all of the same payload, and prints Markdown tables.

mod device;
mod nccl;
mod report;
mod run;
mod traffic;

use std::sync::{Arc, Barrier, Mutex};

use device::fail;
use ep::capi::ep_unique_id_t;
use report::{Report, Value};

const HELP: &str = "\
ep-bench: time ep's dispatch/combine (normal and low-latency modes) on the GPUs of
one host, one thread and one ep context per rank (rank r uses device r mod GPUs:
more ranks than GPUs share them), next to an NCCL all-to-all of the same payload
(one rank per GPU only). Prints Markdown tables for bench/RESULTS.md.

USAGE: ep-bench [OPTIONS]

  --ranks N              ranks (default: all visible GPUs; more ranks than GPUs
                         share the GPUs, each rank with a share of the SMs; host: 2)
  --mode normal|ll|all|traffic
                         which operations (default all); traffic: no timing, the
                         bytes each rank sends over the network and over NVLink
                         in one dispatch + combine, hierarchical (--ranks-per-node)
                         next to single-node paths, from the plans (no GPU needed)
  --ranks-per-node R     ranks per node (default: all ranks one node); below the rank
                         count the timed modes take the network legs (emulated over
                         NVLink on one host), traffic counts their bytes
  --tokens T             tokens per rank (default 4096 normal, 128 ll)
  --hidden H             elements per token, multiple of 128 (default 7168)
  --topk K               experts per token (default 8)
  --experts E            experts in total, divisible by the rank count (default 256)
  --sms S                SMs for the normal-mode kernels (default 24)
  --sms-sweep A,B,..     normal mode once per SM count (e.g. 16,24,32,48,64)
  --sweep-tokens A,B,..  each mode run once per token count (normal e.g. 256,512,...,16384;
                         ll e.g. 1,8,32,64,128,256, at most 1024, one context for all)
  --iters N              timed iterations (default 50 normal, 200 ll)
  --warmup N             untimed iterations first (default 10)
  --graph-pairs N        ll: dispatch+combine pairs captured in one CUDA graph (default 32)
  --timeout-ms MS        ep's peer timeout (default 60000)
  --ungated              time each op from its launch on an idle stream (launch
                         latency included); for profilers such as ncu, which
                         hold every launch until the kernel ran and so would
                         wait forever for a gated stream
  --backend gpu|host     ep backend (default gpu); host is a smoke test: host
                         memory, wall-clock timing, no NCCL, no CUDA graph
  --json FILE            also write the results as JSON (bench/plot.py reads it)
  -h, --help             this text

Every timed iteration starts with all ranks at a barrier; an op's time per
iteration is the slowest rank's (CUDA events on the rank's stream); the table
shows the median, p10 and p90 of that over the iterations. Low-latency ops
(but the CUDA-graph rows) and normal-mode combines are gated: every rank's
stream waits on a host word until all ranks have enqueued the op, so their
times are GPU time without the host's launch latency (the table title says
when the driver cannot gate). GB/s is DeepEP's NVL convention: bytes of tokens
a rank receives (its own included, averaged over ranks) / median time.
";

#[derive(Clone, Debug)]
pub struct Opts {
    pub ranks: Option<usize>,
    pub normal: bool,
    pub ll: bool,
    pub tokens: Option<usize>,
    pub hidden: usize,
    pub topk: usize,
    pub experts: usize,
    pub sms: Vec<i32>,
    pub sweep_tokens: Vec<usize>,
    pub iters: Option<usize>,
    pub warmup: usize,
    pub graph_pairs: usize,
    pub timeout_ms: u32,
    pub gpu: bool,
    pub ungated: bool,
    pub json: Option<String>,
    /// `--mode traffic`: print the traffic tables only.
    pub traffic: bool,
    pub ranks_per_node: Option<usize>,
}

fn parse_list<T: std::str::FromStr>(flag: &str, v: &str) -> Vec<T> {
    v.split(',')
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.trim()
                .parse()
                .unwrap_or_else(|_| usage_error(&format!("{flag}: bad value {s:?}")))
        })
        .collect()
}

fn usage_error(msg: &str) -> ! {
    eprintln!("ep-bench: {msg}\n(see ep-bench --help)");
    std::process::exit(2);
}

fn parse(args: &[String]) -> Opts {
    let mut o = Opts {
        ranks: None,
        normal: true,
        ll: true,
        tokens: None,
        hidden: 7168,
        topk: 8,
        experts: 256,
        sms: vec![24],
        sweep_tokens: Vec::new(),
        iters: None,
        warmup: 10,
        graph_pairs: 32,
        timeout_ms: 60000,
        gpu: true,
        ungated: false,
        json: None,
        traffic: false,
        ranks_per_node: None,
    };
    let mut sms_sweep = None;
    let mut i = 0;
    while i < args.len() {
        let flag = args[i].as_str();
        if flag == "-h" || flag == "--help" {
            print!("{HELP}");
            std::process::exit(0);
        }
        let (name, inline) = match flag.split_once('=') {
            Some((n, v)) => (n, Some(v.to_string())),
            None => (flag, None),
        };
        let mut value = || -> String {
            if let Some(v) = inline.clone() {
                return v;
            }
            i += 1;
            args.get(i)
                .cloned()
                .unwrap_or_else(|| usage_error(&format!("{name} needs a value")))
        };
        let num = |v: String| -> usize {
            v.parse()
                .unwrap_or_else(|_| usage_error(&format!("{name}: bad number {v:?}")))
        };
        match name {
            "--ranks" => o.ranks = Some(num(value())),
            "--ranks-per-node" => o.ranks_per_node = Some(num(value())),
            "--mode" => match value().as_str() {
                "normal" => (o.normal, o.ll) = (true, false),
                "ll" => (o.normal, o.ll) = (false, true),
                "all" => (o.normal, o.ll) = (true, true),
                "traffic" => o.traffic = true,
                m => usage_error(&format!("--mode: {m:?} is not normal, ll, all or traffic")),
            },
            "--tokens" => o.tokens = Some(num(value())),
            "--hidden" => o.hidden = num(value()),
            "--topk" => o.topk = num(value()),
            "--experts" => o.experts = num(value()),
            "--sms" => o.sms = vec![num(value()) as i32],
            "--sms-sweep" => sms_sweep = Some(parse_list::<i32>(name, &value())),
            "--sweep-tokens" => o.sweep_tokens = parse_list(name, &value()),
            "--iters" => o.iters = Some(num(value())),
            "--warmup" => o.warmup = num(value()),
            "--graph-pairs" => o.graph_pairs = num(value()).max(1),
            "--timeout-ms" => o.timeout_ms = num(value()) as u32,
            "--ungated" => o.ungated = true,
            "--json" => o.json = Some(value()),
            "--backend" => match value().as_str() {
                "gpu" => o.gpu = true,
                "host" => o.gpu = false,
                b => usage_error(&format!("--backend: {b:?} is not gpu or host")),
            },
            _ => usage_error(&format!("unknown argument {flag:?}")),
        }
        i += 1;
    }
    if let Some(s) = sms_sweep {
        o.sms = s;
    }
    if o.sms.is_empty() || o.sms.iter().any(|&s| s <= 0) {
        usage_error("SM counts must be positive");
    }
    if o.hidden == 0 || !o.hidden.is_multiple_of(128) || o.hidden > 16384 {
        usage_error("--hidden must be a positive multiple of 128, at most 16384");
    }
    if o.topk == 0 || o.topk > 16 || o.topk > o.experts || o.experts > 1024 {
        usage_error("--topk must be 1..=16 and at most --experts; --experts at most 1024");
    }
    if o.tokens == Some(0) || o.sweep_tokens.contains(&0) {
        usage_error("token counts must be positive");
    }
    o
}

/// UTC date and time from the system clock, "YYYY-MM-DD HH:MM UTC".
fn now_utc() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    let (days, rem) = (secs.div_euclid(86400), secs.rem_euclid(86400));
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
    let z = days + 719468;
    let era = z.div_euclid(146097);
    let doe = z - era * 146097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02} UTC",
        rem / 3600,
        (rem % 3600) / 60
    )
}

/// Fails unless `world` ranks is positive and divides the expert count.
fn check_world(o: &Opts, world: usize) {
    if world == 0 {
        fail("--ranks must be positive");
    }
    if !o.experts.is_multiple_of(world) {
        fail(&format!(
            "--experts {} is not divisible by {world} ranks",
            o.experts
        ));
    }
}

/// State shared by the rank threads.
pub struct Shared {
    pub world: usize,
    /// GPUs the ranks use: rank r is on device r % devices (1 on the host
    /// backend).
    pub devices: usize,
    pub barrier: Barrier,
    pub id: Mutex<Option<ep_unique_id_t>>,
    /// Host address of rank 0's gate word (see `device::Gate`).
    pub gate_word: Mutex<Option<usize>>,
    pub slots: Mutex<Vec<Vec<f64>>>,
    /// The line printed above every table.
    pub header: String,
    /// What `--json` writes; rank 0 fills it.
    pub report: Mutex<Report>,
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let opts = parse(&args[1..]);
    // NVLink SHARP (multicast) stays off on the lent machines; NCCL reads
    // this when it initializes.
    if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
        std::env::set_var("NCCL_NVLS_ENABLE", "0");
    }

    // The command line as printed in every header, the binary as `ep-bench`.
    let command = std::iter::once("ep-bench")
        .chain(args[1..].iter().map(String::as_str))
        .collect::<Vec<_>>()
        .join(" ");

    if opts.traffic {
        let world = opts.ranks.unwrap_or(8);
        check_world(&opts, world);
        let header = format!(
            "{}, traffic of the plans (no device), command: `{command}`",
            now_utc()
        );
        traffic::print(&opts, world, &header);
        return;
    }

    let (world, devices, device_desc) = if opts.gpu {
        if !device::driver_present() {
            fail(
                "no CUDA driver (libcuda.so.1) on this machine; use --backend host for a smoke run",
            );
        }
        let count = device::init_driver();
        if count <= 0 {
            fail("no CUDA device visible");
        }
        let world = opts.ranks.unwrap_or(count as usize);
        let devices = world.min(count as usize);
        let mut desc = format!("{devices} x {}", device::device_name(0));
        if world > devices {
            desc.push_str(&format!(" shared by {world} ranks"));
        }
        (world, devices, desc)
    } else {
        let world = opts.ranks.unwrap_or(2);
        (world, 1, "host backend (no GPU)".to_string())
    };
    check_world(&opts, world);

    // NCCL baseline: one communicator per GPU, made here for all ranks
    // (NCCL takes one rank per GPU).
    let mut nccl_note = "NCCL: not available (host backend)".to_string();
    let mut nccl = None;
    if opts.gpu && world > devices {
        nccl_note = "NCCL: not run (ranks share GPUs)".to_string();
    } else if opts.gpu {
        match nccl::Nccl::load().and_then(|n| n.init_all(world as i32).map(|c| (n, c))) {
            Ok((n, comms)) => {
                let v = n.version;
                nccl_note = format!("NCCL {}.{}.{}", v / 10000, (v / 100) % 100, v % 100);
                nccl = Some((n, comms));
            }
            Err(e) => {
                nccl_note = "NCCL: not available".to_string();
                eprintln!("ep-bench: NCCL: not available ({e})");
            }
        }
    }

    let timing = if opts.gpu {
        "CUDA events"
    } else {
        "std::time::Instant wall clock (host backend)"
    };
    let date = now_utc();
    let nodes = match opts.ranks_per_node {
        Some(rpn) if rpn < world => format!(" in {} nodes of {rpn}", world / rpn.max(1)),
        _ => String::new(),
    };
    let header = format!(
        "{date}, {device_desc}, {world} ranks{nodes}, timing: {timing}, {nccl_note}, command: `{command}`"
    );
    let report = Report {
        header: vec![
            ("date", Value::Str(date)),
            ("device", Value::Str(device_desc.clone())),
            ("ranks", Value::Num(world as f64)),
            (
                "backend",
                Value::Str(if opts.gpu { "gpu" } else { "host" }.into()),
            ),
            ("timing", Value::Str(timing.into())),
            ("nccl", Value::Str(nccl_note.clone())),
            ("command", Value::Str(command)),
        ],
        tables: Vec::new(),
    };

    let shared = Arc::new(Shared {
        world,
        devices,
        barrier: Barrier::new(world),
        id: Mutex::new(None),
        gate_word: Mutex::new(None),
        slots: Mutex::new(vec![Vec::new(); world]),
        header,
        report: Mutex::new(report),
    });
    let opts = Arc::new(opts);
    let mut threads = Vec::new();
    for r in 0..world {
        let shared = Arc::clone(&shared);
        let opts = Arc::clone(&opts);
        let nc = nccl
            .as_ref()
            .map(|(n, c): &(nccl::Nccl, Vec<nccl::Comm>)| (*n, c[r]));
        threads.push(
            std::thread::Builder::new()
                .name(format!("rank{r}"))
                .spawn(move || run::rank_main(r, shared, opts, nc))
                .unwrap_or_else(|e| fail(&format!("spawning rank {r}: {e}"))),
        );
    }
    let mut ok = true;
    for t in threads {
        ok &= t.join().is_ok();
    }
    if let Some((n, comms)) = nccl {
        for c in comms {
            n.destroy(c);
        }
    }
    if !ok {
        fail("a rank thread panicked");
    }
    if let Some(path) = &opts.json {
        let json = shared.report.lock().unwrap().to_json();
        if let Err(e) = std::fs::write(path, json) {
            fail(&format!("--json {path}: {e}"));
        }
    }
}
