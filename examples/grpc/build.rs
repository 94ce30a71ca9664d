//! Compiles `proto/payments.proto` into the service's messages, client and server: in pure
//! Rust (protox), so that no `protoc` needs to be installed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    let descriptors = protox::compile(["payments.proto"], ["proto"])?;
    tonic_prost_build::configure().compile_fds(descriptors)?;
    Ok(())
}
