// The device-plugin API's gRPC code, compiled with protox (pure Rust) so no protoc is needed.
fn main() {
    println!("cargo:rerun-if-changed=proto/deviceplugin.proto");
    let fds = protox::compile(["proto/deviceplugin.proto"], ["proto"])
        .expect("proto/deviceplugin.proto compiles");
    tonic_prost_build::configure()
        .compile_fds(fds)
        .expect("generating the device-plugin gRPC code");
}
