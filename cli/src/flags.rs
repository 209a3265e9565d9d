//! The compile flags as clap arguments, built from the compiler's flag table
//! (`specplan_compiler::config::FLAGS`): each entry's CLI name, help, bounds and default
//! become one `--flag VALUE` argument, and the parsed values go back through the table's
//! setters into `Overrides`. No flag is spelled here.

use clap::{Arg, ArgMatches, Args, FromArgMatches};
use specplan_compiler::config::flags::{FlagValue, Kind};
use specplan_compiler::config::{Overrides, FLAGS};

/// The compile flags of one command line.
#[derive(Clone, Debug, Default)]
pub struct FlagArgs(pub Overrides);

impl FromArgMatches for FlagArgs {
    fn from_arg_matches(m: &ArgMatches) -> Result<Self, clap::Error> {
        let mut o = Overrides::default();
        for f in FLAGS {
            let v = match f.kind {
                Kind::U32 => m.get_one::<u32>(f.key).map(|x| FlagValue::U32(*x)),
                Kind::Text | Kind::IntList | Kind::TextList => {
                    m.get_one::<String>(f.key).map(|x| FlagValue::Text(x.clone()))
                }
            };
            if let Some(v) = v {
                f.set(&mut o, v).map_err(|msg| {
                    clap::Error::raw(clap::error::ErrorKind::ValueValidation, format!("--{}: {msg}\n", f.cli))
                })?;
            }
        }
        Ok(FlagArgs(o))
    }

    fn update_from_arg_matches(&mut self, m: &ArgMatches) -> Result<(), clap::Error> {
        *self = FlagArgs::from_arg_matches(m)?;
        Ok(())
    }
}

impl Args for FlagArgs {
    fn augment_args(cmd: clap::Command) -> clap::Command {
        FLAGS.iter().fold(cmd, |cmd, f| {
            let arg = Arg::new(f.key).long(f.cli).help(f.help_text()).value_name("VALUE");
            let arg = match f.kind {
                Kind::U32 => arg.value_parser(clap::value_parser!(u32)),
                Kind::Text | Kind::IntList | Kind::TextList => arg.value_parser(clap::value_parser!(String)),
            };
            cmd.arg(arg)
        })
    }

    fn augment_args_for_update(cmd: clap::Command) -> clap::Command {
        Self::augment_args(cmd)
    }
}
