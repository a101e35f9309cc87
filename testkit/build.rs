//! Builds `src/cnd_timedwait.c` into a shared library that `Env::skew_clock`
//! preloads beside libfaketime (see the file for why), with the machine's C
//! compiler (`CC`, or `cc`).

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let source = "src/cnd_timedwait.c";
    println!("cargo:rerun-if-changed={source}");
    println!("cargo:rerun-if-env-changed=CC");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"))
        .join("libflashsale_cnd_timedwait.so");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_owned());
    let status = Command::new(&cc)
        .args(["-shared", "-fPIC", "-O2", "-o"])
        .arg(&out)
        .arg(source)
        .arg("-lpthread")
        .status()
        .unwrap_or_else(|e| panic!("running the C compiler {cc}: {e}"));
    assert!(status.success(), "{cc} could not build {source}");
    println!(
        "cargo:rustc-env=FLASHSALE_CND_TIMEDWAIT_SO={}",
        out.display()
    );
}
