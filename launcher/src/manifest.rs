//! Reading a VirtualMachine or VirtualMachineInstance manifest: kind and apiVersion checks,
//! YAML errors with line and column, then KubeVirt defaulting and validation. A file may hold
//! several documents: one VM or VMI, and the instance types and preferences it refers to
//! (more of them can come from a directory); a VM's instance type and preference are expanded
//! into its template as virt-controller does. A VirtualMachineInstanceReplicaSet or a
//! VirtualMachinePool is checked whole and stands for its first replica (`<name>-0`): the VMI or
//! VM virt-controller would make from its template.

use api::validation::{default_vm, default_vmi_spec, validate_vm, validate_vmi, ValidationError};
use api::{VirtualMachine, VirtualMachineInstance, VirtualMachineInstanceSpec};

#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    #[error("{path}: YAML syntax error at line {line}, column {column}: {msg}")]
    Syntax {
        path: String,
        line: usize,
        column: usize,
        msg: String,
    },
    #[error("{path}: {msg}")]
    Schema { path: String, msg: String },
    #[error("{path}: apiVersion {api_version:?} kind {kind:?} is not accepted; accepted: apiVersion kubevirt.io/v1 with kind VirtualMachine, VirtualMachineInstance or VirtualMachineInstanceReplicaSet, or pool.kubevirt.io/v1beta1 VirtualMachinePool")]
    UnknownKind {
        path: String,
        api_version: String,
        kind: String,
    },
    #[error("{path}: {0}", path = .1)]
    Invalid(ValidationError, String),
    #[error("{path}: {err}")]
    Io { path: String, err: std::io::Error },
}

/// A manifest the launcher can run.
#[derive(Clone, Debug)]
pub enum Manifest {
    VirtualMachine(Box<VirtualMachine>),
    VirtualMachineInstance(Box<VirtualMachineInstance>),
}

impl Manifest {
    pub fn name(&self) -> String {
        let meta = match self {
            Manifest::VirtualMachine(vm) => &vm.metadata,
            Manifest::VirtualMachineInstance(vmi) => &vmi.metadata,
        };
        meta.name.clone().unwrap_or_else(|| "vm".into())
    }

    /// Fields that are accepted but change nothing on a microVM (printed as warnings).
    pub fn warnings(&self) -> Vec<String> {
        match self {
            Manifest::VirtualMachine(vm) => api::validation::warnings_vm(vm),
            Manifest::VirtualMachineInstance(vmi) => api::validation::warnings_vmi(vmi),
        }
    }

    /// The VMI spec to run: the VM's template, or the VMI's own spec.
    pub fn vmi_spec(&self) -> &VirtualMachineInstanceSpec {
        match self {
            Manifest::VirtualMachine(vm) => vm.spec.template.spec.as_ref().expect("validated"),
            Manifest::VirtualMachineInstance(vmi) => &vmi.spec,
        }
    }
}

fn location(e: &serde_yaml::Error) -> (usize, usize) {
    e.location().map_or((0, 0), |l| (l.line(), l.column()))
}

/// Instance types and preferences by (kind, name), with where each came from.
#[derive(Default)]
pub struct Library {
    objects: Vec<(String, String, serde_yaml::Value, String)>,
}

const LIBRARY_KINDS: [&str; 4] = [
    "VirtualMachineInstancetype",
    "VirtualMachineClusterInstancetype",
    "VirtualMachinePreference",
    "VirtualMachineClusterPreference",
];

fn syntax(path: &str, e: serde_yaml::Error) -> ManifestError {
    let (line, column) = location(&e);
    ManifestError::Syntax {
        path: path.into(),
        line,
        column,
        msg: strip_location(&e.to_string()),
    }
}

fn kind_of(v: &serde_yaml::Value) -> (String, String) {
    let f = |k: &str| v.get(k).and_then(|v| v.as_str()).unwrap_or("").to_string();
    (f("apiVersion"), f("kind"))
}

impl Library {
    /// Adds the instance types and preferences among `docs`; returns the other documents.
    fn take(&mut self, path: &str, docs: Vec<serde_yaml::Value>) -> Vec<serde_yaml::Value> {
        let mut rest = Vec::new();
        for d in docs {
            let (api_version, kind) = kind_of(&d);
            if api_version.starts_with("instancetype.kubevirt.io/")
                && LIBRARY_KINDS.contains(&kind.as_str())
            {
                let name = d
                    .get("metadata")
                    .and_then(|m| m.get("name"))
                    .and_then(|n| n.as_str())
                    .unwrap_or("")
                    .to_string();
                self.objects.push((kind, name, d, path.to_string()));
            } else {
                rest.push(d);
            }
        }
        rest
    }

    /// Every `*.yaml` / `*.yml` file in `dir`.
    pub fn load_dir(&mut self, dir: &std::path::Path) -> Result<(), ManifestError> {
        let io = |err| ManifestError::Io {
            path: dir.display().to_string(),
            err,
        };
        let mut files: Vec<_> = std::fs::read_dir(dir)
            .map_err(io)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "yaml" || x == "yml"))
            .collect();
        files.sort();
        for f in files {
            let p = f.display().to_string();
            let text = std::fs::read_to_string(&f).map_err(|err| ManifestError::Io {
                path: p.clone(),
                err,
            })?;
            let docs = documents(&p, &text)?;
            self.take(&p, docs);
        }
        Ok(())
    }

    fn find<T: serde::de::DeserializeOwned>(
        &self,
        kind: &str,
        name: &str,
        path: &str,
        what: &str,
    ) -> Result<T, ManifestError> {
        let (_, _, v, from) = self
            .objects
            .iter()
            .find(|(k, n, _, _)| k == kind && n == name)
            .ok_or_else(|| ManifestError::Schema {
                path: path.into(),
                msg: format!(
                    "spec.{what}: {} {name:?} not found (looked for {kind} {name} in this file and --instancetype-dir)",
                    if what == "instancetype" { "instance type" } else { "preference" }
                ),
            })?;
        let spec = v.get("spec").cloned().unwrap_or_default();
        serde_yaml::from_value(spec).map_err(|e| ManifestError::Schema {
            path: from.clone(),
            msg: format!("{kind} {name}: spec: {e}"),
        })
    }
}

fn documents(path: &str, text: &str) -> Result<Vec<serde_yaml::Value>, ManifestError> {
    use serde::Deserialize;
    let mut out = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(text) {
        let v = serde_yaml::Value::deserialize(doc).map_err(|e| syntax(path, e))?;
        if !v.is_null() {
            out.push(v);
        }
    }
    Ok(out)
}

/// Parses, defaults and validates.
pub fn parse(path: &str, text: &str) -> Result<Manifest, ManifestError> {
    parse_with(path, text, Library::default())
}

/// `parse`, with instance types and preferences from `library` besides those in the file.
pub fn parse_with(path: &str, text: &str, mut library: Library) -> Result<Manifest, ManifestError> {
    let all = documents(path, text)?;
    let single = all.len() == 1;
    let mut docs = library.take(path, all);
    if docs.len() != 1 {
        return Err(ManifestError::Schema {
            path: path.into(),
            msg: format!(
                "{} VirtualMachine/VirtualMachineInstance documents; exactly one is accepted (with any number of instance types and preferences)",
                docs.len()
            ),
        });
    }
    let value = docs.remove(0);
    // A file of one document is read as it is, so schema errors point at its own lines.
    let owned;
    let text = if single {
        text
    } else {
        owned = serde_yaml::to_string(&value).map_err(|e| syntax(path, e))?;
        owned.as_str()
    };
    let field = |k: &str| {
        value
            .get(k)
            .and_then(|v| v.as_str())
            .unwrap_or("")
            .to_string()
    };
    let (api_version, kind) = (field("apiVersion"), field("kind"));
    let schema = |e: serde_yaml::Error| ManifestError::Schema {
        path: path.into(),
        msg: e.to_string(),
    };
    match (api_version.as_str(), kind.as_str()) {
        ("kubevirt.io/v1", "VirtualMachine")
        | ("pool.kubevirt.io/v1beta1", "VirtualMachinePool") => {
            let mut vm: VirtualMachine = if kind == "VirtualMachinePool" {
                let pool: api::VirtualMachinePool = serde_yaml::from_str(text).map_err(schema)?;
                api::validation::validate_pool(&pool)
                    .map_err(|e| ManifestError::Invalid(e, path.into()))?;
                api::validation::pool_vm(&pool, 0)
            } else {
                serde_yaml::from_str(text).map_err(schema)?
            };
            default_vm(&mut vm);
            validate_vm(&vm).map_err(|e| ManifestError::Invalid(e, path.into()))?;
            if vm.spec.instancetype.is_some() || vm.spec.preference.is_some() {
                expand(&mut vm, &library, path)?;
            }
            Ok(Manifest::VirtualMachine(Box::new(vm)))
        }
        ("kubevirt.io/v1", "VirtualMachineInstanceReplicaSet") => {
            let mut rs: api::VirtualMachineInstanceReplicaSet =
                serde_yaml::from_str(text).map_err(schema)?;
            if let Some(spec) = rs.spec.template.spec.as_mut() {
                default_vmi_spec(spec);
            }
            api::validation::validate_vmirs(&rs)
                .map_err(|e| ManifestError::Invalid(e, path.into()))?;
            let t = rs.spec.template;
            let name = rs.metadata.name.unwrap_or_else(|| "vmirs".into());
            let mut vmi = VirtualMachineInstance::new(
                &format!("{name}-0"),
                t.spec.expect("validated: the template has a spec"),
            );
            vmi.metadata.namespace = rs.metadata.namespace;
            vmi.metadata.labels = t.metadata.as_ref().and_then(|m| m.labels.clone());
            Ok(Manifest::VirtualMachineInstance(Box::new(vmi)))
        }
        ("kubevirt.io/v1", "VirtualMachineInstance") => {
            let mut vmi: VirtualMachineInstance = serde_yaml::from_str(text).map_err(schema)?;
            default_vmi_spec(&mut vmi.spec);
            validate_vmi(&vmi).map_err(|e| ManifestError::Invalid(e, path.into()))?;
            Ok(Manifest::VirtualMachineInstance(Box::new(vmi)))
        }
        _ => Err(ManifestError::UnknownKind {
            path: path.into(),
            api_version,
            kind,
        }),
    }
}

/// The VM's template expanded with its instance type and preference, then defaulted, as
/// virt-controller makes its VMI.
fn expand(vm: &mut VirtualMachine, library: &Library, path: &str) -> Result<(), ManifestError> {
    use api::instancetype::{instancetype_kind, preference_kind};
    let bad = |msg: String| ManifestError::Schema {
        path: path.into(),
        msg,
    };
    let it = match &vm.spec.instancetype {
        Some(m) => {
            let (kind, _) = instancetype_kind(m).map_err(bad)?;
            Some(library.find::<api::instancetype::InstancetypeSpec>(
                kind,
                &m.name,
                path,
                "instancetype",
            )?)
        }
        None => None,
    };
    let pref = match &vm.spec.preference {
        Some(m) => {
            let (kind, _) = preference_kind(m).map_err(bad)?;
            Some(library.find::<api::instancetype::PreferenceSpec>(
                kind,
                &m.name,
                path,
                "preference",
            )?)
        }
        None => None,
    };
    let spec = vm.spec.template.spec.as_mut().expect("validated");
    api::instancetype::expand(spec, it.as_ref(), pref.as_ref(), "spec.template.spec")
        .map_err(bad)?;
    default_vmi_spec(spec);
    let vmi =
        VirtualMachineInstance::new(&vm.metadata.name.clone().unwrap_or_default(), spec.clone());
    validate_vmi(&vmi).map_err(|e| ManifestError::Invalid(e, path.into()))
}

pub fn read(path: &str) -> Result<Manifest, ManifestError> {
    read_with(path, None)
}

/// `read`, with instance types and preferences also looked for in `instancetype_dir`.
pub fn read_with(
    path: &str,
    instancetype_dir: Option<&std::path::Path>,
) -> Result<Manifest, ManifestError> {
    let text = std::fs::read_to_string(path).map_err(|err| ManifestError::Io {
        path: path.into(),
        err,
    })?;
    let mut library = Library::default();
    if let Some(d) = instancetype_dir {
        library.load_dir(d)?;
    }
    parse_with(path, &text, library)
}

/// serde_yaml writes " at line L column C" into its messages; the error already says where.
fn strip_location(msg: &str) -> String {
    let mut out = msg.to_string();
    while let Some(i) = out.find(" at line ") {
        let rest = &out[i + " at line ".len()..];
        let end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == ' ' || c.is_ascii_alphabetic()))
            .unwrap_or(rest.len());
        out = format!("{}{}", &out[..i], &rest[end..]);
    }
    out
}
